"""survey: versions from distribution metadata, states, what run would do; parallel = serial."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, cli, fixture_folder, make_vllm_tree
from test_fixtures import FAILS_WHEN_RUN, VARIANTS
from test_real_wheels import PREFIX, VERSIONS, vllm_wheel

from rewriter import commands
from rewriter.apply import FileStatus
from rewriter.survey import survey_targets
from rewriter.targets import Target, dist_version_beside, resolve

POISON = "raise RuntimeError('{} was imported')\n"


@pytest.fixture(scope="module")
def wheel_sites(tmp_path_factory) -> dict[str, Path]:
    """Each real wheel laid out as a site-packages: the minimax_m3/nvidia tree and its dist-info."""
    sites = {}
    for version in VERSIONS:
        root = tmp_path_factory.mktemp(f"site-packages-{version}")
        with zipfile.ZipFile(vllm_wheel(version)) as wheel:
            for name in wheel.namelist():
                if (name.startswith(PREFIX) and name.endswith(".py")) or name.endswith(".dist-info/METADATA"):
                    wheel.extract(name, root)
        (root / "vllm" / "__init__.py").write_text(POISON.format("vllm"))
        sites[version] = root
    return sites


def by_file(report: dict) -> dict[str, dict]:
    return {f["path"]: f for f in report["files"]}


def insert_states(entry: dict) -> list[str]:
    return [s["state"] for s in entry["sites"] if s["state"] != "not-a-site"]


def test_survey_fixtures_and_real_wheels(tmp_path: Path, wheel_sites: dict[str, Path]) -> None:
    folder = fixture_folder(tmp_path / "fixtures", VARIANTS)
    args = ["survey", "--json", str(folder)]
    for version in VERSIONS:
        args += ["--vllm-root", str(wheel_sites[version])]
    proc = cli(*args)
    # two_candidates is refused, as check would.
    assert proc.returncode == 2, proc.stderr
    report = json.loads(proc.stdout)
    assert report["command"] == "survey" and report["exit_code"] == 2
    files = by_file(report)

    for name, (states, _) in VARIANTS.items():
        entry = files[str(folder / name / "model.py")]
        assert entry["vllm_version"] == "unknown"
        ran = ["unsupported" if name in FAILS_WHEN_RUN else s.value for s in states]  # as check says
        assert insert_states(entry) == ran, name

    for version, root in wheel_sites.items():
        model = files[str(root / PREFIX / "model.py")]
        assert model["vllm_version"] == version
        assert insert_states(model) == ["native"]
        native = next(s for s in model["sites"] if s["state"] == "native")
        assert native["class"] == "MiniMaxM3SparseAttention" and native["action"] == "none"
        others = [f for p, f in files.items() if p.startswith(str(root)) and not p.endswith("/model.py")]
        assert others and all(f["vllm_version"] == version for f in others)
        assert all(f["status"] in ("unchanged", "no-sites") for f in others)

    # The table on stderr, read as wide: each file on a line, then a row per insert site.
    wide = cli(*args[:1], *args[2:], env={"COLUMNS": "240"})
    rows = table_rows(wide.stderr)
    for version in VERSIONS:
        native_rows = [r for r in rows if r["vLLM"] == version and r["state"] == "native"]
        assert [r["site"].split(":")[0] for r in native_rows] == ["MiniMaxM3SparseAttention.forward"]
        assert native_rows[0]["run would"] == "nothing"
    fork = next(r for r in rows if r["file"].endswith("/fork_era/model.py"))
    assert fork["vLLM"] == "unknown" and fork["site"] == "MiniMaxM3SparseAttention.forward:276"
    assert (fork["state"], fork["run would"]) == ("needs-bypass", "rewrite")
    assert fork["why"].startswith("fork-era insert call")
    half = next(r for r in rows if r["file"].endswith("half_applied/model.py"))
    assert (half["state"], half["run would"]) == ("half-applied", "complete")
    assert "missing: flag, guard" in half["why"]
    stale = next(r for r in rows if r["file"].endswith("native_stale_bypass/model.py"))
    assert (stale["state"], stale["run would"]) == ("half-applied", "strip")
    lost = next(r for r in rows if r["file"].endswith("half_native/model.py"))
    assert "NameError" in lost["why"] or "never assigned" in lost["why"]
    assert not any("mtp.py" in r["file"] for r in rows)  # files without the op: counted, not listed
    assert "files without the fused op" in proc.stderr


def table_rows(stderr: str) -> list[dict[str, str]]:
    """survey's table, read back: a line per file, then its rows; a row's state cell may go
    on with "-> <action>" on the next line. Each row: vLLM, file, site, state, run would, why."""
    lines = stderr.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("vLLM "))
    names = ("vLLM", "site", "state", "why")
    starts = [lines[head].index(name) for name in names]
    rows: list[dict[str, str]] = []
    file = ""
    for line in lines[head + 2 :]:
        if line.startswith("error:") or re.match(r"\d+ files? ", line):
            break
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
        if not line.startswith(" ") and not re.match(r"\S+ {2,}\S", line):
            file = line.strip()
        elif not line.startswith(" "):
            rows.append(dict(zip(names, cells), file=file, **{"run would": "nothing"}))
        elif cells[2].startswith("-> "):
            rows[-1]["run would"] = cells[2][3:]
            rows[-1]["why"] += " " + cells[3]
        else:
            rows[-1]["why"] += " " + cells[3]
    return rows


def test_jobs_2_gives_the_same_report_as_jobs_1(tmp_path: Path, wheel_sites: dict[str, Path]) -> None:
    folder = fixture_folder(tmp_path / "states")  # a file in each state, and a vLLM's files
    common = ["survey", "--json", str(folder), "--vllm-root", str(wheel_sites[VERSIONS[0]])]
    one = cli(*common, "--jobs", "1")
    two = cli(*common, "-j", "2")
    assert one.returncode == two.returncode == 2
    assert json.loads(one.stdout) == json.loads(two.stdout)
    assert one.stderr == two.stderr


def test_library_survey_in_parallel_equals_serial(tmp_path: Path) -> None:
    names = ["native", "dense_only", "native_stale_bypass", "two_candidates", "no_insert_kv"]
    targets = [Target(FIXTURES / name / "model.py", "test") for name in names]
    ticks: list[int] = []
    serial = survey_targets(targets, jobs=1)
    parallel = survey_targets(targets, jobs=2, advance=lambda: ticks.append(1))
    assert len(ticks) == len(targets)
    assert [f.to_json() for f in parallel.files] == [f.to_json() for f in serial.files]


@pytest.mark.parametrize(
    ("variants", "code"),
    [
        (["patched", "native", "dense_only"], 0),
        (["patched", "fork_era"], 1),
        (["native", "two_candidates"], 2),
    ],
)
def test_exit_codes_as_check(tmp_path: Path, variants: list[str], code: int) -> None:
    paths = []
    for name in variants:
        target = tmp_path / name / "model.py"
        target.parent.mkdir()
        shutil.copyfile(FIXTURES / name / "model.py", target)
        paths.append(str(target))
    assert cli("survey", *paths).returncode == code
    assert cli("check", *paths).returncode == code


def test_version_from_metadata_beside_the_package(tmp_path: Path) -> None:
    make_vllm_tree(tmp_path, {"model.py": (FIXTURES / "native" / "model.py").read_bytes()})
    info = tmp_path / "vllm-0.29.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: vllm\nVersion: 0.29.1\n\nVersion: 9\n")
    assert dist_version_beside(tmp_path / "vllm") == "0.29.1"
    (tmp_path / "vllm_flash_attn-2.0.dist-info").mkdir()  # another distribution: ignored
    assert dist_version_beside(tmp_path / "vllm") == "0.29.1"
    other = tmp_path / "vllm-0.30.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Name: vllm\nVersion: 0.30.0\n")
    assert dist_version_beside(tmp_path / "vllm") is None  # two disagree: unknown


def test_python_option_reads_importlib_metadata(tmp_path: Path) -> None:
    """--python: the metadata found by that interpreter's importlib.metadata (an
    editable install keeps it away from the package), never importing vllm."""
    packages, metadata = tmp_path / "src", tmp_path / "meta"
    make_vllm_tree(
        packages, {"model.py": (FIXTURES / "fork_era" / "model.py").read_bytes()}, POISON.format("vllm")
    )
    (metadata / "vllm-0.27.3.dist-info").mkdir(parents=True)
    (metadata / "vllm-0.27.3.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.4\nName: vllm\nVersion: 0.27.3\n"
    )
    env = {"PYTHONPATH": f"{packages}:{metadata}"}
    proc = cli("survey", "--json", "--python", sys.executable, env=env)
    assert proc.returncode == 1, proc.stderr
    (entry,) = json.loads(proc.stdout)["files"]
    assert entry["vllm_version"] == "0.27.3"
    assert insert_states(entry) == ["needs-bypass"]
    assert "0.27.3" in proc.stderr


def test_torch_and_vllm_are_never_imported(tmp_path: Path) -> None:
    """survey and revert run with poisoned torch and vllm first on the path."""
    poison = tmp_path / "poison"
    for name in ("torch", "vllm"):
        (poison / name).mkdir(parents=True)
        (poison / name / "__init__.py").write_text(POISON.format(name))
    work = tmp_path / "work"
    work.mkdir()
    for name in ("fork_era", "patched", "native"):
        shutil.copyfile(FIXTURES / name / "expected.py", work / f"{name}.py")
    script = textwrap.dedent(
        f"""
        import sys
        from rewriter.cli import main
        for args in (["survey", "-j", "2", {str(work)!r}], ["revert", "--whole-bypass", {str(work)!r}]):
            try:
                main(args, plain=False)
            except SystemExit as exc:
                assert exc.code == 0, (args, exc.code)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm"))
        print("loaded:", loaded)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{poison}:{ROOT}"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "loaded: []" in proc.stdout
    assert "was imported" not in proc.stderr
    assert (work / "patched.py").read_bytes() == (FIXTURES / "patched" / "reverted.py").read_bytes()


def test_progress_bar_only_on_a_terminal_and_never_with_json(tmp_path: Path) -> None:
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(10):  # more targets than the progress threshold, small ones
        shutil.copyfile(FIXTURES / "native" / "model.py", folder / f"model_{i}.py")
    assert len(resolve(paths=[folder])) > 8
    tty = {"TTY_COMPATIBLE": "1"}
    human = cli("survey", str(folder), env=tty)
    assert "surveying" in human.stderr
    as_json = cli("survey", "--json", str(folder), env=tty)
    json.loads(as_json.stdout)  # stdout is one JSON document
    assert "surveying" not in as_json.stderr and "surveying" not in as_json.stdout
    piped = cli("survey", str(folder), env={"TTY_COMPATIBLE": "0"})
    assert "surveying" not in piped.stderr


def test_target_error_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = cli("survey", "--vllm-root", str(tmp_path))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert str(tmp_path) in line and "not a vLLM checkout" in line


def test_targets_keep_their_version(tmp_path: Path) -> None:
    make_vllm_tree(tmp_path, {"model.py": b"# nothing\n"})
    (tmp_path / "vllm-0.25.0.dist-info").mkdir()
    (tmp_path / "vllm-0.25.0.dist-info" / "METADATA").write_text("Name: vllm\nVersion: 0.25.0\n")
    (target,) = resolve(vllm_roots=[tmp_path])
    assert (target.origin, target.vllm_version) == (f"--vllm-root {tmp_path}", "0.25.0")
    (plain,) = resolve(paths=[target.path])
    assert plain.vllm_version is None


@pytest.mark.parametrize("width", [80, 100, 140])
def test_readable_at_every_width(tmp_path: Path, wheel_sites: dict[str, Path], width: int) -> None:
    """Every line fits; every folder, file, class and method name shows whole (folded only
    after a "/" or a "."); paths are relative to the working folder; each row says why."""
    fork = tmp_path / "forks" / "minimax-m3-fp8-fork"
    make_vllm_tree(fork, {"model.py": (FIXTURES / "half_applied" / "model.py").read_bytes()})
    folder = fixture_folder(tmp_path / "fixtures", VARIANTS)
    args = ["--vllm-root", str(fork), str(folder / "two_candidates"), str(folder / "fork_era")]
    for version in VERSIONS:
        args += ["--vllm-root", str(wheel_sites[version])]
    report = json.loads(cli("survey", "--json", *args, cwd=tmp_path).stdout)
    proc = cli("survey", *args, cwd=tmp_path, env={"COLUMNS": str(width)})
    assert proc.returncode == 2, proc.stderr  # two_candidates is refused
    table = proc.stderr.split("\nerror:")[0]
    lines = [line.rstrip() for line in table.splitlines()]
    assert max(len(line) for line in lines) <= width
    words = {word for line in lines for word in re.split(r"[ /.:()]+", line)}
    listed = [f for f in report["files"] if f["sites"]]
    assert len(listed) == 5
    for entry in listed:
        path = Path(entry["path"])  # relative under the working folder; the wheels' absolute
        relative = path.relative_to(tmp_path) if path.is_relative_to(tmp_path) else path
        assert str(relative) in "".join(line.strip() for line in lines)  # relative, whole when joined
        pieces = [piece for part in relative.parts for piece in re.split(r"[ /.:()]+", part) if piece]
        assert set(pieces) <= words, relative
        for site in entry["sites"]:
            if site["state"] != "not-a-site":
                assert {site["class"], site["method"]} <= words, (site, width)
    assert str(tmp_path) not in table
    assert lines[1].split() == ["vLLM", "site", "state", "why"]
    for version in VERSIONS:
        assert re.search(rf"^{re.escape(version)} +MiniMaxM3SparseAttention\.", table, re.M), version


def interpreter(path: Path, body: str) -> str:
    """An executable script standing in for another environment's python."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_an_environment_without_vllm_is_a_row_not_an_abort(tmp_path: Path) -> None:
    """Several --python: one without vLLM, one whose vLLM cannot be looked up, one with a fork's:
    the first two are no-vllm rows (nothing to do there), the third is surveyed as ever."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has a real vLLM installed")
    fork, empty = tmp_path / "fork", tmp_path / "empty"
    model = (FIXTURES / "fork_era" / "model.py").read_bytes()
    make_vllm_tree(fork, {"model.py": model}, POISON.format("vllm"))
    empty.mkdir()
    with_vllm = interpreter(tmp_path / "with-vllm", f'PYTHONPATH={fork} exec {sys.executable} "$@"')
    without = interpreter(tmp_path / "without", f'PYTHONPATH={empty} exec {sys.executable} "$@"')
    broken = interpreter(tmp_path / "broken", """echo '{"error": "ValueError: vllm.__spec__ is None"}'""")
    args = ["--python", without, "--python", with_vllm, "--python", broken]
    proc = cli("survey", "--json", *args)
    assert proc.returncode == 1, proc.stderr  # the fork's needs-bypass, as if the others were not named
    report = json.loads(proc.stdout)
    files = by_file(report)
    assert insert_states(files[str(fork / PREFIX / "model.py")]) == ["needs-bypass"]
    assert files[without]["status"] == files[broken]["status"] == "no-vllm"
    assert files[without]["origin"] == f"--python {without}" and files[without]["vllm_version"] is None
    assert files[without]["error"] == "vLLM is not installed in this environment"
    assert files[broken]["error"] == "cannot look up vllm: ValueError: vllm.__spec__ is None"
    assert report["summary"]["no-vllm"] == 2 and report["exit_code"] == 1
    rows = {r["file"]: r for r in table_rows(cli("survey", *args, env={"COLUMNS": "200"}).stderr)}
    assert (rows[without]["vLLM"], rows[without]["state"]) == ("-", "no-vllm")
    assert rows[broken]["why"].startswith("cannot look up vllm")
    alone = cli("survey", "--python", without)
    assert alone.returncode == 0, alone.stderr  # nothing to rewrite there, as no-sites
    assert "1 environment without vLLM." in alone.stderr and "error" not in alone.stderr
    # check has no such row: its targets are files, and one it cannot find is an error.
    assert cli("check", *args).returncode == 2


SCM_VERSION_FILE = """\
# file generated by setuptools-scm
# don't change, don't track in version control
__all__ = ["__version__", "__version_tuple__", "version", "version_tuple"]
TYPE_CHECKING = False
version: str
__version__: str
__version__ = version = '0.26.1.dev12+g1a2b3c4'
__version_tuple__ = version_tuple = (0, 26, 1, 'dev12', 'g1a2b3c4')
"""


def git(folder: Path, *args: str) -> str:
    identity = ["-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    proc = subprocess.run(["git", "-C", str(folder), *identity, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def surveyed_versions(*args: str, cwd: Path | None = None) -> set[str]:
    proc = cli("survey", "--json", *args, cwd=cwd)
    assert proc.returncode in (0, 1), proc.stderr
    return {f["vllm_version"] for f in json.loads(proc.stdout)["files"]}


def test_a_checkouts_version_from_its_version_file(tmp_path: Path) -> None:
    """setuptools-scm's vllm/_version.py (read, never imported), else an old tree's version.py."""
    native = (FIXTURES / "native" / "model.py").read_bytes()
    scm, old, none = tmp_path / "scm", tmp_path / "old", tmp_path / "none"
    for tree in (scm, old, none):
        make_vllm_tree(tree, {"model.py": native}, POISON.format("vllm"))
    (scm / "vllm" / "_version.py").write_text(SCM_VERSION_FILE + "raise RuntimeError('imported')\n")
    (old / "vllm" / "version.py").write_text('import warnings\n__version__ = "0.6.1"\n__commit__ = "abc"\n')
    (none / "vllm" / "version.py").write_text("from ._version import __version__\n")  # nothing literal
    assert surveyed_versions("--vllm-root", str(scm)) == {"0.26.1.dev12+g1a2b3c4"}
    assert surveyed_versions("--vllm-root", str(old / "vllm")) == {"0.6.1"}  # the package layout too
    assert surveyed_versions("--vllm-root", str(none)) == {"unknown"}
    proc = cli("survey", "--vllm-root", str(scm), env={"COLUMNS": "200"})
    assert {r["vLLM"] for r in table_rows(proc.stderr)} == {"0.26.1.dev12+g1a2b3c4"}


def test_a_checkouts_version_from_git_describe(tmp_path: Path) -> None:
    """A fork checkout with no version file: `git describe --tags`, its "v" dropped; a
    site-packages that only lies inside some repository is not told that repository's tag."""
    native = (FIXTURES / "native" / "model.py").read_bytes()
    fork = tmp_path / "fork"
    make_vllm_tree(fork, {"model.py": native}, POISON.format("vllm"))
    git(fork, "init", "-q")
    git(fork, "add", "-A")
    git(fork, "commit", "-qm", "base")
    git(fork, "tag", "v0.25.0")
    assert surveyed_versions("--vllm-root", str(fork)) == {"0.25.0"}
    (fork / "vllm" / "patch.py").write_text("# the fork's own change\n")
    git(fork, "add", "-A")
    git(fork, "commit", "-qm", "fork")
    head = git(fork, "rev-parse", "--short", "HEAD")
    (version,) = surveyed_versions("--vllm-root", str(fork))
    assert re.fullmatch(rf"0\.25\.0-1-g{head}[0-9a-f]*", version), version
    # The tree around the working folder (no vLLM installed here to make that a question).
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        assert surveyed_versions(cwd=fork / "vllm" / "models") == {version}
    # Only survey shows versions: check asks git nothing.
    assert {t.vllm_version for t in resolve(vllm_roots=[fork])} == {None}
    site = fork / "venv" / "site-packages"
    make_vllm_tree(site, {"model.py": native}, POISON.format("vllm"))
    assert surveyed_versions("--vllm-root", str(site)) == {"unknown"}


def test_git_describe_without_git_or_a_repository_or_a_tag(tmp_path: Path, monkeypatch) -> None:
    from rewriter.targets import git_describe

    assert git_describe(tmp_path) is None  # not a checkout
    git(tmp_path, "init", "-q")
    (tmp_path / "a").write_text("a\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "a")
    assert git_describe(tmp_path) is None  # no tag
    git(tmp_path, "tag", "v1.2.3")
    assert git_describe(tmp_path) == "1.2.3"
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    assert git_describe(tmp_path) is None  # git absent: unknown, no failure


# --- the AMD model file beside the NVIDIA one -------------------------------------------------


def test_a_fork_era_tree_with_both_model_files(tmp_path: Path) -> None:
    """A fork-era checkout holding nvidia/model.py (no bypass) and amd/model.py (the seed's
    bypass): survey lists both, with the checkout's version; after run, both are patched."""
    from test_targets import two_platform_tree

    fork = tmp_path / "fork"
    two_platform_tree(fork)
    git(fork, "init", "-q")
    git(fork, "add", "-A")
    git(fork, "commit", "-qm", "fork era")
    git(fork, "tag", "v0.24.0")
    proc = cli("survey", "--json", "--vllm-root", str(fork))
    assert proc.returncode == 1, proc.stderr
    files = by_file(json.loads(proc.stdout))
    nvidia = files[str(fork / "vllm/models/minimax_m3/nvidia/model.py")]
    amd = files[str(fork / "vllm/models/minimax_m3/amd/model.py")]
    assert nvidia["vllm_version"] == amd["vllm_version"] == "0.24.0"
    assert insert_states(nvidia) == ["needs-bypass"] and insert_states(amd) == ["outdated"]
    rows = table_rows(cli("survey", "--vllm-root", str(fork), env={"COLUMNS": "240"}).stderr)
    shown = {(Path(r["file"]).parent.name, r["state"], r["run would"]) for r in rows}
    assert shown == {("nvidia", "needs-bypass", "rewrite"), ("amd", "outdated", "upgrade")}
    assert cli("run", "--vllm-root", str(fork)).returncode == 0
    rows = table_rows(cli("survey", "--vllm-root", str(fork), env={"COLUMNS": "240"}).stderr)
    assert {(Path(r["file"]).parent.name, r["state"]) for r in rows} == {("nvidia", "patched"), ("amd", "patched")}


AMD_PREFIX = PREFIX.replace("/nvidia/", "/amd/")
# Native sites of each release's AMD model.py: 0.34.0 has two (its plain call with and without
# the index branch), beside norm+rope-only calls whose cache aiter or NVFP4 code writes.
AMD_NATIVE = {"0.24.0": 1, "0.34.0": 2}


@pytest.fixture(scope="module", params=VERSIONS)
def amd_site(request, tmp_path_factory) -> tuple[str, Path]:
    """A real wheel as a site-packages with both model folders, amd/ (every file) beside nvidia/."""
    version = request.param
    root = tmp_path_factory.mktemp(f"site-packages-amd-{version}")
    with zipfile.ZipFile(vllm_wheel(version)) as wheel:
        for name in wheel.namelist():
            if (name.startswith((PREFIX, AMD_PREFIX)) and name.endswith(".py")) or name.endswith(
                ".dist-info/METADATA"
            ):
                wheel.extract(name, root)
    (root / "vllm" / "__init__.py").write_text(POISON.format("vllm"))
    assert (root / AMD_PREFIX / "model.py").stat().st_size > 40_000
    return version, root


def test_real_wheels_amd_files_are_native_or_not_a_site(amd_site: tuple[str, Path]) -> None:
    """PyPI's AMD model files are native: every fused call is native or a not-a-site call with
    its reason, nothing in amd/ needs a rewrite, and run writes nothing."""
    version, root = amd_site
    proc = cli("survey", "--json", "--vllm-root", str(root))
    assert proc.returncode == 0, proc.stderr
    files = by_file(json.loads(proc.stdout))
    amd = {p: f for p, f in files.items() if f"/{AMD_PREFIX}" in p}
    assert len(amd) > 1 and all(f["vllm_version"] == version for f in amd.values())
    assert all(f["status"] in ("unchanged", "no-sites") for f in files.values())
    model = amd[str(root / AMD_PREFIX / "model.py")]
    assert insert_states(model) == ["native"] * AMD_NATIVE[version]
    for site in model["sites"]:
        assert site["action"] == "none" and site["reason"]
        if site["state"] == "native":
            assert site["class"] == "MiniMaxM3SparseAttention" and "--kv-cache-dtype fp8" in site["reason"]
        else:
            assert site["state"] == "not-a-site" and "norm+rope-only" in site["reason"]
    before = {p: p.read_bytes() for p in root.rglob("*.py")}
    assert cli("run", "--vllm-root", str(root)).returncode == 0
    assert {p: p.read_bytes() for p in root.rglob("*.py")} == before


def test_survey_judges_a_patched_bypass_as_check_does(tmp_path: Path) -> None:
    """A wired bypass that is not run's own and fails when run: check refuses it, and so does
    the survey's row (one judgement, ``commands.judge``)."""
    from rewriter.survey import survey_file

    source = (FIXTURES / "fork_era" / "expected.py").read_text()
    old = "            main_slot_mapping,\n            self.kv_cache_dtype,\n"
    assert source.count(old) == 1
    path = tmp_path / "model.py"
    path.write_text(source.replace(old, '            main_slot_mapping,\n            "auto",\n'))
    surveyed = survey_file(path)
    (checked,) = commands.analyze_targets("check", [Target(path, "t")]).files
    assert surveyed.status is checked.status is FileStatus.REFUSED
    assert [s.reason for s in surveyed.sites] == [s.reason for s in checked.sites]
