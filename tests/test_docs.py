"""Every state a command prints is one the README explains, and a file without an
insert site says why instead of only "1 file left unchanged"."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

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
