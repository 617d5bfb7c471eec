"""Every state a command prints is one the README explains, and a file without an
insert site says why instead of only "1 file left unchanged"."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, cli
from test_fixtures import VARIANTS

from codemods.schema import SiteState

README = (ROOT / "README.md").read_text()

# The parameters of the fused op, in the fork-era order: the wrapper passes each through.
PARAMS = (
    "qkv q_weight k_weight cos_sin_cache positions num_heads num_kv_heads rotary_dim eps"
    " index_q_weight index_k_weight num_index_heads slot_mapping index_slot_mapping"
    " kv_cache index_cache block_size q index_q"
).split()


def wrapper_file(folder: Path) -> Path:
    """The seed's patched file with its layer calling the op through a module-level pass-through."""
    source = (FIXTURES / "patched" / "model.py").read_text()
    layer = source.index("class MiniMaxM3SparseAttention")
    call = source.index("ops.fused_minimax_m3_qknorm_rope_kv_insert(", layer)
    source = (
        source[:call] + "fused_insert(" + source[call + len("ops.fused_minimax_m3_qknorm_rope_kv_insert(") :]
    )
    first_class = source.index("\nclass ")
    wrapper = (
        f"\n\ndef fused_insert({', '.join(PARAMS)}):\n"
        '    """A pass-through to the fused op."""\n'
        f"    ops.fused_minimax_m3_qknorm_rope_kv_insert({', '.join(PARAMS)})\n"
    )
    target = folder / "wrapper" / "model.py"
    target.parent.mkdir(parents=True)
    target.write_text(source[:first_class] + wrapper + source[first_class:])
    return target


def readme_section(title: str) -> str:
    """The README's text from the heading ``title`` to the next heading of its level or above."""
    match = re.search(rf"^(#+) {re.escape(title)}\n", README, re.M)
    assert match, title
    level = len(match.group(1))
    rest = README[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def test_every_site_state_is_in_the_readme_table() -> None:
    """Derived from the enum: a new state fails here until the README explains it."""
    table = readme_section("Site states")
    documented = set(re.findall(r"^\| `([a-z-]+)` \|", table, re.M))
    assert {state.value for state in SiteState} <= documented


def test_a_file_with_no_insert_site_says_why(tmp_path: Path) -> None:
    """A patched file whose op is reached through a module-level wrapper, and a file with
    only the dense layer's call: check names each call and its reason, not only a count."""
    wrapper = wrapper_file(tmp_path)
    dense = tmp_path / "dense_only.py"
    shutil.copyfile(FIXTURES / "dense_only" / "model.py", dense)
    for target in (wrapper, dense):
        proc = cli("check", str(target))
        assert proc.returncode == 0, proc.stderr
        lines = proc.stderr.splitlines()
        sites = [i for i, line in enumerate(lines) if re.match(rf"{re.escape(str(target))}:\d+: ", line)]
        assert sites, proc.stderr
        assert all(lines[i + 1].startswith("    ") and lines[i + 1].strip() for i in sites)  # a reason each


def test_every_state_survey_and_check_print_is_documented(tmp_path: Path) -> None:
    """Over every fixture, the wrapper file, a file without the op and one that is not
    Python, with --all: each state (or file status) shown is explained in the README."""
    folder = tmp_path / "targets"
    for name in VARIANTS:
        (folder / name).mkdir(parents=True)
        shutil.copyfile(FIXTURES / name / "model.py", folder / name / "model.py")
    wrapper_file(folder)
    (folder / "no_op.py").write_text("x = 1\n")
    (folder / "broken.py").write_text("def f(:\n    ops.fused_minimax_m3_qknorm_rope_kv_insert(x)\n")
    proc = cli("survey", "--all", "--json", str(folder), env={"COLUMNS": "200"})
    report = json.loads(proc.stdout)
    shown = {s["state"] for f in report["files"] for s in f["sites"]}
    shown |= {f["status"] for f in report["files"] if not f["sites"]}
    assert {"no-sites", "error", "not-a-site", "needs-bypass", "half-applied"} <= shown
    head = next(line for line in proc.stderr.splitlines() if line.startswith("vLLM "))
    column = head.index("state")
    printed = {
        line[column:].split()[0]
        for line in proc.stderr.splitlines()
        if len(line) > column and re.match(r"\S+ {2,}\S", line) and not line.startswith("vLLM ")
    }
    assert printed == shown
    documented = readme_section("Site states") + readme_section("`survey` — every environment at once")
    for state in shown:
        assert f"`{state}`" in documented, state


# ---- the commands the README and docs/ show, run as written -----------------------------

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_blocks(text: str) -> list[str]:
    """The text of each fenced code block (its fence line left out)."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def shown_commands() -> list[tuple[str, str, list[str], int | None]]:
    """Each `$ mm3-codemod …` in a page's code blocks whose paths are this repository's (or
    `--example`): (page, command, the output lines shown under it but for those shortened
    with "…", the exit code a following `$ echo $?` shows)."""
    found = []
    for page in PAGES:
        for block in code_blocks(page.read_text()):
            lines = block.splitlines()
            for i, line in enumerate(lines):
                if not line.startswith("$ mm3-codemod "):
                    continue
                command = line[2:].split("  #")[0].strip()
                paths = [w for w in command.split() if "/" in w and not w.startswith(("'", "(", "--"))]
                if not ("--example" in command or paths) or not all((ROOT / p).exists() for p in paths):
                    continue
                out, code = [], None
                for after in lines[i + 1 :]:
                    if after.startswith("$ echo $?"):
                        continue
                    if after.startswith("$ "):
                        break
                    if after.strip().isdigit() and code is None:
                        code = int(after)
                        continue
                    if after.strip() and "…" not in after:
                        out.append(after)
                found.append((page.name, command, out, code))
    return found


def test_some_shown_commands_are_runnable_here() -> None:
    assert {c for _, c, _, _ in shown_commands()} >= {
        "mm3-codemod run fixtures/two_candidates/model.py",
        "mm3-codemod verify --example",
    }


@pytest.mark.parametrize("page, command, out, code", shown_commands(), ids=lambda x: str(x)[:60])
def test_shown_commands_print_what_the_page_shows(page, command, out, code) -> None:
    proc = subprocess.run(
        command.replace("mm3-codemod", f"{sys.executable} -m rewriter", 1).replace("python -c", f"{sys.executable} -c"),
        shell=True, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
    )
    printed = (proc.stdout + proc.stderr).splitlines()
    for line in out:
        assert line in printed, f"{page}: `{command}` no longer prints: {line}"
    if code is not None:
        assert proc.returncode == code, f"{page}: `{command}` exits {proc.returncode}"


# ---- the README: short, with what a reader looks for first ------------------------------


def test_readme_is_short_and_starts_with_what_a_reader_wants() -> None:
    """At most 400 lines; the two commands first, then the launch command with an fp8 KV cache
    near the top; what `revert` restores said where the README describes it."""
    assert len(README.splitlines()) <= 400
    blocks = code_blocks(README)
    assert blocks[:2] == [
        "pip install . && mm3-codemod run --example --show-diff",
        "pip install '.[test]' && pytest",
    ]
    top = README.split("\n## ", 1)[0]
    (launch,) = [b for b in code_blocks(top) if "vllm serve" in b]
    assert "--kv-cache-dtype fp8" in launch and "mm3-codemod run" in launch
    revert = readme_section("`revert` — take the bypass out again")
    assert "attn_metadata" in revert and "revert(run(x)) == x" in revert


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_reach_their_page_and_heading() -> None:
    """Detail moved out of the README must still be found: every relative link of it names a
    file that exists, and a heading of it where it names one."""
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        page = ROOT / path if path else ROOT / "README.md"
        assert page.is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, target


def test_the_plugin_page_names_what_the_plugin_reads() -> None:
    """docs/plugin.md's modes, variables and plugin names are the ones the code and the
    package's entry points use."""
    import tomllib

    from mm3_codemod import plugin

    text = (ROOT / "docs" / "plugin.md").read_text()
    entries = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert plugin.APPLY_ENTRY in entries and set(entries.values()) == {"mm3_codemod.plugin:register"}
    for name in [*entries, *plugin.MODES, plugin.MODE_VAR, "MM3_CODEMOD_SERVE_CACHE", "VLLM_PLUGINS"]:
        assert name in text, name
