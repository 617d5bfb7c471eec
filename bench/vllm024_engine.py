"""The engine level's experiments on the GPU machine (run by bench/vllm024_engine.sh).

With vLLM 0.24.0 installed from the carry (``--site``):
  (1) 0.24.0's own nvidia/model.py made fork-era (the sparse fused call's
      ``kv_cache_dtype`` argument removed; a copy in a temp folder, never
      committed): before ``mm3-codemod run`` its fp8 engine run must fail with the
      kernel's bf16-only assert; ``run`` rewrites it; after, the bf16 and the fp8
      runs complete;
  (2) the rewritten file's fp8 run against 0.24.0's own file's native fp8 run
      (both unit scale: the same tokens expected), and each against bf16;
  (3) the same with enforce_eager=True, with block_size=256 (the manager's blocks over
      the kernels' 128) and block_size=16 (which vLLM 0.24 refuses for MiniMax-M3 itself:
      its sparse attention and indexer backends take 128-token pages only);
  (4) what the threshold stands on: the rewritten fp8 run again (is the engine
      deterministic?) and three known-broken variants of the bypass (MUTANTS: the cache
      never written, one slot off, padded tokens written over a real token's slot) against bf16 and
      against the native fp8 run - garbage, measured beside the noise floor.
Each run is one process of rewriter/verify/engine_child.py (one JSON line): the
first fills the kernel caches (~190 s on the H200), the others then take ~14 s
each, one at a time (processes side by side break vLLM's memory profiling), under a
deadline. Any run's failure leaves the others; a table at the end, everything in
OUT/engine.json and the runs' log tails in OUT/engine_main.log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from rewriter.verify.engine import (  # noqa: E402
    MIN_AGREEMENT,
    MIN_PROMPT_AGREEMENT,
    Capacity,
    capacity_ratio,
    compare_outputs,
    judge_results,
)

CHILD = REPO / "rewriter" / "verify" / "engine_child.py"
FP8 = "fp8_e4m3"
CONFIGS = {  # name: (block_size, enforce_eager)
    "graphs,bs128": (128, False),
    "eager,bs128": (128, True),
    "graphs,bs256": (256, False),  # the manager's 256-token blocks, the kernels' 128
    "graphs,bs16": (16, False),  # refused by vLLM 0.24 itself: M3's sparse backends take 128 only
}
# Known-broken variants of the rewritten file (edits of the bypass's insert call), served
# with an fp8 cache: what a broken cache does to the agreement, against the noise floor.
INSERT_CALL = "self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)"
MUTANTS = {
    "unwritten": "pass  # mutant: the fp8 cache is never written",
    "shifted": "self._insert_kv(k, v, index_k, torch.where(main_slot_mapping >= 0, "
    "main_slot_mapping + 1, main_slot_mapping), index_slot_mapping)  # mutant: one slot off",
    "padded": "self._insert_kv(k, v, index_k, torch.where(main_slot_mapping >= 0, main_slot_mapping, "
    "main_slot_mapping.max()), index_slot_mapping)  # mutant: padded tokens (slot -1) written over a real one",
}


def mutate(text: str, edit: str) -> str:
    if text.count(INSERT_CALL) != 1:
        raise SystemExit(f"the rewritten file's insert call: {text.count(INSERT_CALL)} matches, expected 1")
    return text.replace(INSERT_CALL, edit)


def fork_era(text: str) -> str:
    """The sparse call without its kv_cache_dtype argument (the fork's 19-argument call)."""
    new, n = re.subn(r"(\n[ \t]+index_q,\n)[ \t]+self\.kv_cache_dtype,\n([ \t]+\)\n)", r"\1\2", text)
    if n != 1:
        raise SystemExit(f"the sparse call's kv_cache_dtype argument: {n} matches, expected 1")
    return new


def mm3(*args: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "mm3_codemod", *args], capture_output=True, text=True, cwd=REPO
    )
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def start(spec: dict, work: Path, name: str) -> tuple[subprocess.Popen, Path, float]:
    spec_file = work / f"{name}.json"
    spec_file.write_text(json.dumps({**spec, "workdir": str(work / name)}))
    log = work / f"{name}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, str(CHILD), str(spec_file)], stdout=subprocess.PIPE, stderr=err, text=True)
    return proc, log, time.time()


def finish(proc: subprocess.Popen, log: Path, t: float, name: str, end: float) -> dict:
    try:
        stdout, _ = proc.communicate(timeout=max(end - time.time(), 1))
        res = json.loads(stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        res = {"status": "failed", "reason": f"{name}: killed at the deadline", "jobs": []}
    except (IndexError, json.JSONDecodeError):
        tail = log.read_text(errors="replace").strip().splitlines()[-6:]
        res = {"status": "failed", "reason": f"{name}: exited {proc.returncode} with no report", "jobs": [], "tail": tail}
    res["wall_s"] = round(time.time() - t, 1)
    for j in res.get("jobs", []):
        msg = f" {j.get('exc_type')}: {j.get('message', '')[:150]}" if j.get("status") != "ok" else ""
        print(f"    {j['label']}: {j.get('status')} ({j.get('phase')}) {j.get('seconds')} s{msg}", flush=True)
    if not res.get("jobs"):
        print(f"    {name}: {res['status']} {res.get('reason', '')}", flush=True)
    return res


def run_all(common: dict, jobs: list[dict], work: Path, out: Path, end: float, parallel: int) -> dict:
    """One engine process per job (vLLM does not clean up for a second LLM in a process: seen
    on the H200, every later LLM raised in init). The first runs alone and fills the Triton and
    flashinfer caches; the rest `parallel` at a time, each with its share of GPU memory."""
    results, logs = {}, []
    waves = [jobs[:1]] + [jobs[i : i + parallel] for i in range(1, len(jobs), parallel)]
    share = {"gpu_memory_utilization": round(0.8 / parallel, 3)}
    for wave in waves:
        if time.time() > end - 60:
            for j in wave:
                results[j["label"]] = {"status": "not-run", "jobs": [{"label": j["label"], "status": "not-run"}]}
            continue
        started = [(j, *start({**common, **share, "jobs": [j]}, work, f"job{len(logs) + i}")) for i, j in enumerate(wave)]
        for j, proc, log, t in started:
            results[j["label"]] = finish(proc, log, t, j["label"], end)
            logs.append((j["label"], log))
    with open(out / "engine_main.log", "w") as merged:  # at most 8 files come back: one log
        for label, log in logs:
            merged.write(f"===== {label}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-150:]) + "\n")
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=float(os.environ.get("ENGINE_BUDGET", 500)))
    a = ap.parse_args()
    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="v24eng-"))
    orig = Path(a.site, "vllm/models/minimax_m3/nvidia/model.py")
    before, after = work / "fork_era_model.py", work / "rewritten_model.py"
    before.write_text(fork_era(orig.read_text()))
    after.write_text(before.read_text())
    steps = {}
    steps["check_before"] = mm3("check", str(before))
    steps["run"] = mm3("run", str(after))
    steps["check_after"] = mm3("check", str(after))
    steps["check_native"] = mm3("check", str(orig))
    for k, (rc, text) in steps.items():
        print(f"mm3-codemod {k}: exit {rc}: {text.splitlines()[0] if text else ''}")
    common = json.loads(os.environ.get("ENGINE_SPEC", "{}"))  # e.g. {"new_tokens": 32}
    backend = os.environ.get("ENGINE_BACKEND", "TRITON_ATTN")
    files = {"rewritten": after, "native": orig, "fork-era": before}
    for name, edit in MUTANTS.items():  # known-broken caches: what garbage measures
        files[name] = work / f"{name}_model.py"
        files[name].write_text(mutate(after.read_text(), edit))

    def job(label: str, dtype: str, cfg: str, tag: str = "") -> dict:
        bs, eager = CONFIGS[cfg]
        return {
            "label": f"{label}:{dtype}@{cfg}{tag}",
            "file": str(files[label]),
            "kv_cache_dtype": dtype,
            "block_size": bs,
            "backend": backend,
            "enforce_eager": eager,
        }

    g = "graphs,bs128"
    all_jobs = [
        job("rewritten", "auto", g), job("rewritten", FP8, g), job("native", FP8, g),
        job("fork-era", FP8, g), job("native", "auto", g), job("rewritten", FP8, g, " again"),
        *(job(m, FP8, g) for m in MUTANTS),
    ]
    for cfg in ("eager,bs128", "graphs,bs256"):
        all_jobs += [job("rewritten", "auto", cfg), job("rewritten", FP8, cfg), job("native", FP8, cfg)]
    all_jobs += [job("native", FP8, "graphs,bs16"), job("rewritten", FP8, "graphs,bs16")]
    only = os.environ.get("ENGINE_ONLY")  # a regex: run only the jobs whose label it finds
    all_jobs = [j for j in all_jobs if not only or re.search(only, j["label"])]
    parallel = int(os.environ.get("ENGINE_PARALLEL", 1))  # 3 at once broke vLLM's memory profiling (H200)
    results = run_all(common, all_jobs, work, out, t0 + a.budget, parallel)
    first = next((r for r in results.values() if r.get("env")), {})
    jobs = {j["label"]: j for r in results.values() for j in r.get("jobs", [])}

    def outputs(label):
        j = jobs.get(label)
        return j["outputs"] if j and j.get("status") == "ok" else None

    comps = []
    for cfg in ("graphs,bs128", "eager,bs128", "graphs,bs256"):
        ra, rf, nf = (f"rewritten:auto@{cfg}", f"rewritten:{FP8}@{cfg}", f"native:{FP8}@{cfg}")
        pairs = [
            (ra, rf, "bypass fp8 vs bf16"),
            (ra, nf, "native fp8 vs bf16 (the noise floor)"),
            (nf, rf, "bypass fp8 vs native fp8"),
        ]
        if cfg == g:
            pairs += [
                (f"native:auto@{g}", ra, "bf16: rewritten vs native"),
                (rf, f"{rf} again", "bypass fp8 vs itself, run again"),
                *((ra, f"{m}:{FP8}@{g}", f"garbage: {m} vs bf16") for m in MUTANTS),
                *((nf, f"{m}:{FP8}@{g}", f"garbage: {m} vs native fp8") for m in MUTANTS),
            ]
        for x, y, what in pairs:
            if outputs(x) is not None and outputs(y) is not None:
                c = compare_outputs(x, outputs(x), y, outputs(y))
                comps.append({"config": cfg, "what": what, **c.to_json()})
            else:
                comps.append({"config": cfg, "what": what, "a": x, "b": y, "missing": True})
    verdicts = {}
    for cfg in ("graphs,bs128", "eager,bs128", "graphs,bs256", "graphs,bs16"):
        for tested in ("rewritten", *(MUTANTS if cfg == g else ())):
            sub = {"status": "ok", "env": first.get("env"), "jobs": []}
            for src, dst in (
                (f"rewritten:auto@{cfg}", "file:auto"),
                (f"{tested}:{FP8}@{cfg}", f"file:{FP8}"),
                (f"native:{FP8}@{cfg}", f"native:{FP8}"),
            ):
                if src in jobs:
                    sub["jobs"].append({**jobs[src], "label": dst})
            if sub["jobs"] and all(j.get("status") in ("ok", "raised") for j in sub["jobs"]):
                v = judge_results(sub, files[tested], [])
                verdicts[f"{tested}@{cfg}"] = {"status": v.status, "reason": v.reason}
    bj = jobs.get(f"fork-era:{FP8}@graphs,bs128", {})
    exp1_before = (
        "fails as expected: " + bj.get("message", "")[:160]
        if bj.get("status") == "raised"
        and "must match" in bj.get("message", "") + " ".join(bj.get("traceback", []))
        else f"UNEXPECTED: {bj.get('status')} {bj.get('exc_type', '')}: {bj.get('message', '')[:160]}"
    )
    caps = {label: Capacity.of({**j, "label": label}) for label, j in jobs.items()}
    ratios = {}
    for cfg in ("graphs,bs128", "eager,bs128", "graphs,bs256"):
        bf16 = caps.get(f"rewritten:auto@{cfg}")
        for run in ("rewritten", "native"):
            r = capacity_ratio(bf16, caps.get(f"{run}:{FP8}@{cfg}"))
            if r is not None:
                ratios[f"{run} fp8 / rewritten bf16 @{cfg}"] = round(r, 4)
    report = {
        "capacity": {"runs": {k: c.to_json() for k, c in caps.items() if c}, "ratios": ratios},
        "steps": {k: {"exit": rc, "output": t[-2000:]} for k, (rc, t) in steps.items()},
        "results": results,
        "comparisons": comps,
        "verdicts": verdicts,
        "exp1_before": exp1_before,
        "min_agreement": MIN_AGREEMENT,
        "wall_s": round(time.time() - t0, 1),
    }
    (out / "engine.json").write_text(json.dumps(report, indent=1))

    print("\n| run | status | phase | s | error |\n|---|---|---|---:|---|")
    for label, j in jobs.items():
        err = f"{j.get('exc_type')}: {j.get('message', '')[:90]}" if j.get("status") != "ok" else ""
        print(
            f"| {label} | {j.get('status')} | {j.get('phase')} | {j.get('seconds')} | "
            f"{err.replace('|', '/')} |"
        )
    print(
        "\n| config | comparison | prompt top-1 agreement | prompt max abs d logprob "
        "| greedy: identical seqs | greedy agreement | first divergence | greedy max abs d logprob |"
    )
    print("|---|---|---:|---:|---|---:|---:|---:|")

    def num(x, f="{:.4g}"):
        return "-" if x is None else f.format(x)

    for c in comps:
        if c.get("missing"):
            print(f"| {c['config']} | {c['what']} | (a run is missing) | - | - | - | - | - |")
            continue
        print(
            f"| {c['config']} | {c['what']} | {num(c.get('prompt_agreement'), '{:.4f}')} | "
            f"{num(c.get('prompt_max_dlogprob'))} | {c['identical']}/{c['sequences']} | "
            f"{c['agreement']:.3f} | {num(c['first_divergence'], '{}')} | {num(c['max_dlogprob'])} |"
        )
    print(
        "\n| run | KV blocks | block size | tokens (blocks x size) | vLLM's kv_cache_size_tokens "
        "| KV bytes | bytes/token | gpu_memory_utilization |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for label, c in caps.items():
        if c:
            per = c.bytes_per_token
            print(
                f"| {label} | {c.blocks:,} | {c.block_size} | {c.tokens:,} | {num(c.vllm_tokens, '{:,}')} | "
                f"{num(c.kv_bytes, '{:,}')} | {num(per, '{:.1f}')} | {c.gpu_memory_utilization} |"
            )
    for what, r in ratios.items():
        print(f"KV-cache tokens, {what}: {r:.4f}")
    print(f"\n(1) before `run`, fp8: {exp1_before}")
    print(
        f"(1) `run` exit {steps['run'][0]}; check after exit {steps['check_after'][0]}; "
        f"native file check exit {steps['check_native'][0]}"
    )
    for cfg, v in verdicts.items():
        print(f"engine level on the rewritten file, {cfg}: {v['status']}: {v['reason'][:300]}")
    def measured(what: str, key: str) -> list:
        return [c.get(key) for c in comps if c["what"].startswith(what) and not c.get("missing")]

    for name, limit, key in (
        ("MIN_AGREEMENT", MIN_AGREEMENT, "agreement"),
        ("MIN_PROMPT_AGREEMENT", MIN_PROMPT_AGREEMENT, "prompt_agreement"),
    ):
        print(
            f"threshold {name}={limit}; measured: noise floor {measured('native fp8 vs bf16', key)}, "
            f"garbage {measured('garbage', key)}"
        )
    env = first.get("env") or {}
    print(
        "env: "
        + json.dumps({k: env.get(k) for k in ("vllm", "torch", "gpu", "import_seconds", "notes", "config")})
    )
    print(f"engine experiments: {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
