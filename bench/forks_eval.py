"""Evaluate mm3-codemod on real fork versions of the MiniMax-M3 model file.

    python bench/forks_eval.py DIR [--json OUT]

For every ``*.py`` in DIR (fork files live outside the checkout; they never enter it):

a. the ``check`` verdict: ``rewriter.apply.plan_file`` -> each site's state, action, reason;
b. semantic truth: ``python -m rewriter verify --json --tp 1`` on the original (verdict
   native / patched / not-a-site) or on ``run --no-prove``'s output (a changing verdict);
c. for files ``run`` rewrote: ``revert`` on the output, compared byte for byte with the original;
d. ruff with vLLM's rule set on the original and the output: findings ``run`` adds, and
   whether ``ruff format --check`` passed before and after.

Outcomes: right / refused / unproven / wrong (and run-failed: check promised a change that
``run`` did not write). Nothing here edits DIR: every command runs on a temporary copy.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from codemods.schema import CHANGING, Action
from rewriter.apply import FileStatus, plan_file

RUFF_RULES = "E,F,UP,B,ISC,SIM,I,G"
FINDING = re.compile(r"^.*?:(\d+):(\d+): (.*)$")
CLI = [sys.executable, "-m", "rewriter"]
STAND_IN = re.compile(r"the stand-in cannot|not modelled by the stand-in")


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200")
    return subprocess.run(
        [*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


# --- a. the check verdict ---------------------------------------------------------------


def verdict_of(path: Path) -> dict:
    result = plan_file(path)
    sites = [
        {
            "line": s.line,
            "where": f"{s.class_name}.{s.method}",
            "state": s.state.value,
            "action": s.action.value,
            "reason": s.reason,
        }
        for s in result.sites
    ]
    refusals = [s for s in result.sites if s.action == Action.REFUSE]
    changes = [s for s in result.sites if s.action in CHANGING]
    if result.status in (FileStatus.REFUSED, FileStatus.ERROR) or refusals:
        if refusals:
            reason = f"{refusals[0].state.value} at {refusals[0].line}: {refusals[0].reason}"
        else:
            reason = result.error or result.status.value
        verdict, kind = "refused", "refused"
    elif changes:
        verdict = "+".join(sorted({s.action.value for s in changes}))
        kind, reason = "change", changes[0].reason
    else:
        states = sorted({s.state.value for s in result.sites}) or ["no-sites"]
        keep = [s for s in states if s != "not-a-site"] or states
        verdict, kind, reason = "+".join(keep), "keep", ""
    return {
        "status": result.status.value,
        "verdict": verdict,
        "kind": kind,
        "reason": reason,
        "error": result.error,
        "sites": sites,
    }


# --- b. semantic truth --------------------------------------------------------------------


def semantic(path: Path) -> dict:
    proc = cli("verify", "--json", "--tp", "1", str(path))
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"status": "error", "reason": (proc.stderr or proc.stdout)[-400:], "details": []}
    files = report.get("files") or []
    if not files:
        return {"status": "error", "reason": report.get("error") or "no file in report", "details": []}
    entry = files[0]
    for level in entry.get("levels") or []:
        if level.get("level") == "semantic":
            return {
                "status": level.get("status"),
                "reason": level.get("reason"),
                "details": level.get("details") or [],
                "file_status": entry.get("status"),
                "note": entry.get("note"),
            }
    # No semantic row at all: the file was not verifiable (no site, unreadable...).
    return {
        "status": "absent",
        "reason": entry.get("note") or entry.get("error") or entry.get("unverified") or entry.get("status"),
        "details": [],
        "file_status": entry.get("status"),
    }


# --- d. ruff ------------------------------------------------------------------------------


def ruff_findings(path: Path) -> tuple[list[tuple[int, str]], str]:
    proc = subprocess.run(
        ["ruff", "check", "--isolated", "--select", RUFF_RULES, "--line-length", "88",
         "--target-version", "py310", "--no-cache", "--output-format", "concise", str(path)],
        capture_output=True, text=True, check=False,
    )
    out = []
    for line in proc.stdout.splitlines():
        m = FINDING.match(line)
        if m and line.startswith(str(path)):
            out.append((int(m.group(1)), m.group(3).strip()))
    return out, proc.stderr.strip()


def ruff_format_ok(path: Path) -> bool:
    proc = subprocess.run(
        ["ruff", "format", "--isolated", "--check", "--line-length", "88", str(path)],
        capture_output=True, text=True, check=False,
    )
    return proc.returncode == 0


def new_findings(original: Path, output: Path) -> list[dict]:
    before, _ = ruff_findings(original)
    after, _ = ruff_findings(output)
    old = collections.Counter(msg for _, msg in before)
    new = collections.Counter(msg for _, msg in after)
    added = new - old
    old_lines = set(original.read_text(encoding="utf-8", errors="replace").splitlines())
    out_lines = output.read_text(encoding="utf-8", errors="replace").splitlines()
    result = []
    for msg, count in sorted(added.items()):
        lines = [
            {"line": n, "text": out_lines[n - 1].rstrip() if 0 < n <= len(out_lines) else ""}
            for n, m in after
            if m == msg
        ]
        generated = [entry for entry in lines if entry["text"] not in old_lines] or lines
        result.append({"finding": msg, "count": count, "lines": generated[:5]})
    return result


# --- c. revert ----------------------------------------------------------------------------


def revert_check(rewritten: Path, original: bytes, work: Path) -> dict:
    copy = work / "revert" / rewritten.name
    copy.parent.mkdir(exist_ok=True)
    shutil.copyfile(rewritten, copy)
    proc = cli("revert", "--json", str(copy))
    got = copy.read_bytes()
    if proc.returncode == 2 or (proc.returncode != 0 and got == rewritten.read_bytes()):
        return {"result": "refused", "exit": proc.returncode, "reason": refusal_reason(proc)}
    if got == original:
        return {"result": "undo", "exit": proc.returncode}
    a = original.decode("utf-8", "replace").splitlines()
    b = got.decode("utf-8", "replace").splitlines()
    diff = list(difflib.unified_diff(a, b, "original", "reverted", n=0, lineterm=""))
    changed = [d for d in diff if d[:1] in "+-" and not d.startswith(("+++", "---"))]
    return {
        "result": "differs" if got != rewritten.read_bytes() else "unchanged",
        "exit": proc.returncode,
        "lines_differing": len(changed),
        "first": changed[:8],
    }


def refusal_reason(proc: subprocess.CompletedProcess) -> str:
    try:
        report = json.loads(proc.stdout)
        for f in report.get("files") or []:
            for s in f.get("sites") or []:
                if s.get("action") == "refuse":
                    return f"{s.get('state')} at {s.get('line')}: {s.get('reason')}"
            if f.get("error"):
                return f["error"]
        if report.get("error"):
            return report["error"]
    except json.JSONDecodeError:
        pass
    return (proc.stderr.strip().splitlines() or [""])[-1]


# --- one file -----------------------------------------------------------------------------


def evaluate(path: Path) -> dict:
    original = path.read_bytes()
    row: dict = {"file": path.name}
    row.update(verdict_of(path))
    with tempfile.TemporaryDirectory(prefix="forks_eval_") as tmp:
        work = Path(tmp)
        if row["kind"] == "refused":
            row["outcome"] = "refused"
            row["refusal"] = row["reason"][:120]
            row["semantic"] = semantic(path)  # for the record: is the file itself broken?
            return row
        if row["kind"] == "keep":
            sem = semantic(path)
            row["semantic"] = sem
            row["outcome"] = outcome(sem)
            return row
        copy = work / path.name
        shutil.copyfile(path, copy)
        proc = cli("run", "--no-prove", "--json", str(copy))
        row["run_exit"] = proc.returncode
        if copy.read_bytes() == original:
            row["outcome"] = "run-failed"
            row["run_error"] = refusal_reason(proc)
            row["semantic"] = semantic(path)
            return row
        sem = semantic(copy)
        row["semantic"] = sem
        row["outcome"] = outcome(sem)
        row["revert"] = revert_check(copy, original, work)
        orig_copy = work / "orig" / path.name
        orig_copy.parent.mkdir(exist_ok=True)
        orig_copy.write_bytes(original)
        row["ruff_new"] = new_findings(orig_copy, copy)
        row["format_before"] = ruff_format_ok(orig_copy)
        row["format_after"] = ruff_format_ok(copy)
        a = original.decode("utf-8", "replace").splitlines()
        b = copy.read_bytes().decode("utf-8", "replace").splitlines()
        row["diff_lines"] = sum(
            1 for d in difflib.unified_diff(a, b, n=0, lineterm="")
            if d[:1] in "+-" and not d.startswith(("+++", "---"))
        )
    return row


def outcome(sem: dict) -> str:
    status = sem.get("status")
    if status == "passed":
        return "right"
    if status == "failed":
        # ``--tp 1`` asks for the row, so a stand-in that cannot model the file reports a
        # failure (verify's rule for a row asked for): that is no proof either way.
        if STAND_IN.search(sem.get("reason") or ""):
            sem["stand_in_limit"] = True
            return "unproven"
        return "wrong"
    return "unproven"


# --- report -------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    lines = [f"{'file':44} {'verdict':22} {'outcome':10} {'revert':9} {'+ruff':>5} fmt b/a"]
    for r in rows:
        rev = r.get("revert", {}).get("result", "-")
        ruff = sum(f["count"] for f in r.get("ruff_new", [])) if "ruff_new" in r else "-"
        fmt = (
            f"{'ok' if r['format_before'] else 'FAIL'}/{'ok' if r['format_after'] else 'FAIL'}"
            if "format_before" in r else "-"
        )
        lines.append(f"{r['file'][:44]:44} {r['verdict'][:22]:22} {r['outcome']:10} {rev:9} {ruff!s:>5} {fmt}")
    return "\n".join(lines)


def totals(rows: list[dict]) -> dict:
    out = collections.Counter(r["outcome"] for r in rows)
    reasons = collections.Counter(r["refusal"] for r in rows if r["outcome"] == "refused")
    reverts = collections.Counter(r["revert"]["result"] for r in rows if "revert" in r)
    ruff_adds = [r["file"] for r in rows if r.get("ruff_new")]
    fmt_broken = [r["file"] for r in rows if r.get("format_before") and not r.get("format_after")]
    return {
        "files": len(rows),
        "outcomes": dict(out),
        "verdicts": dict(collections.Counter(r["verdict"] for r in rows)),
        "refusal_reasons": dict(reasons),
        "revert": dict(reverts),
        "ruff_adds": ruff_adds,
        "format_broken": fmt_broken,
        "wrong": [
            {"file": r["file"], "verdict": r["verdict"], "reason": r["reason"][:300],
             "semantic": r["semantic"].get("reason")}
            for r in rows if r["outcome"] == "wrong"
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--json", type=Path, dest="json_out")
    args = parser.parse_args(argv)
    if shutil.which("ruff") is None:
        print("ruff is not installed: pip install ruff", file=sys.stderr)
        return 2
    files = sorted(args.dir.glob("*.py"))
    start = tool_state()
    rows = []
    for i, path in enumerate(files, 1):
        print(f"[{i}/{len(files)}] {path.name}", file=sys.stderr, flush=True)
        try:
            rows.append(evaluate(path))
        except Exception as exc:  # noqa: BLE001 -- one file's crash is a result, not the end of the run
            rows.append({"file": path.name, "verdict": "crash", "kind": "crash", "reason": repr(exc),
                         "outcome": "crash"})
    print(table(rows))
    tot = totals(rows)
    print()
    print(json.dumps({k: v for k, v in tot.items() if k != "wrong"}, indent=1))
    for w in tot["wrong"]:
        print(f"WRONG {w['file']}: {w['verdict']}: {w['semantic']}")
    end = tool_state()
    if start != end:  # someone edited the tool mid-run: the rows may disagree with each other
        print(f"warning: the tool changed during the run ({start} -> {end})", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps(
            {"tool_at_start": start, "tool_at_end": end, "totals": tot, "rows": rows}, indent=1))
    return 0


def tool_state() -> dict:
    """The checkout's commit and uncommitted changes (codemods/, rewriter/), to date the results."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    diff = subprocess.run(
        ["git", "-C", str(ROOT), "diff", "HEAD", "--", "codemods", "rewriter"],
        capture_output=True, text=True, check=False,
    )
    return {"head": head.stdout.strip(), "dirty_diff_lines": len(diff.stdout.splitlines())}


if __name__ == "__main__":
    sys.exit(main())
