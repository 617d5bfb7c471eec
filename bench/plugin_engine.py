"""On the GPU machine (bench/plugin_device.sh): the mm3-codemod vLLM plugin, installed as a
user installs it (``pip install``: its ``vllm.general_plugins`` entry points), in front of
vLLM 0.24.0 whose own ``nvidia/model.py`` is made fork-era in place (the sparse call without
its ``kv_cache_dtype`` argument, as the forks' file; the tool never edits it here):

1. the plugin's own cost, each in a fresh interpreter: loading it (what every vLLM process
   pays), judging the native and the fork-era file (check), and apply's proof, cold and from
   the cache;
2. starts of ``vllm.LLM`` on a tiny random-weight MiniMax-M3 (rewriter/verify/engine_child.py's
   checkpoint, CUDA graphs, block size 128, TRITON_ATTN), vLLM importing the model itself:
   check + fp8 on the fork-era file (must stop before any weight loads: the time to the
   stop), check + bf16 on it (never stopped), apply + fp8 on it (served from the proven
   rewrite), 0.24.0's native file + fp8 (check passes it), and apply + fp8 again with the
   engine core in its own process (vLLM's default; it must serve the same proven rewrite);
3. the engine level's comparisons of those outputs (rewriter.verify.engine.compare_outputs).

    python bench/plugin_engine.py --site SITE --out OUT --budget SECONDS
Out: OUT/plugin.json, OUT/plugin_logs.txt.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm024_engine import fork_era  # the engine bench's fork-era edit, one copy
FP8 = "fp8_e4m3"

COSTS = r"""
import json, os, sys, time
from pathlib import Path
import torch  # a vLLM process has it already: not the plugin's cost
step, path = sys.argv[1], Path(sys.argv[2])
os.environ["MM3_CODEMOD_SERVE_CACHE"] = sys.argv[3]
t = time.perf_counter()
import mm3_codemod.plugin as plugin
if step == "load":
    plugin.install("check")
else:
    mode, _, when = step.partition("_")
    verdict = plugin.ModelHook(mode).judge(path)  # at import
    if when == "fp8" and isinstance(verdict, plugin.Stop):  # the first layer built for fp8
        verdict = verdict.settled()
print(json.dumps({"s": round(time.perf_counter() - t, 3), "answer": type(verdict).__name__ if step != "load" else ""}))
"""
# (measure, step, file, cache folder): a fresh folder is a first start, the same one a later
# start; "written" is the file `run` wrote, its verdict left in folder "w" (or not: "h", a
# file patched some other way, or `run` under another user's cache)
COST_STEPS = (
    ("load_and_install", "load", "native", "a"),
    ("check_native", "check_import", "native", "a"),
    ("check_fork_era_bf16_start", "check_import", "era", "b"),
    ("check_fork_era_fp8_first", "check_fp8", "era", "b"),
    ("check_fork_era_fp8_again", "check_fp8", "era", "b"),
    ("check_run_written_fp8", "check_fp8", "written", "w"),
    ("check_patched_not_by_this_run_fp8_first", "check_fp8", "written", "h"),
    ("apply_fork_era_first", "apply_import", "era", "c"),
    ("apply_fork_era_again", "apply_import", "era", "c"),
)


def costs(work: Path) -> dict:
    """Each step in a fresh interpreter (as each vLLM start is one)."""
    written = work / "written" / "model.py"
    written.parent.mkdir()
    shutil.copyfile(work / "era" / "model.py", written)
    env = {**os.environ, "MM3_CODEMOD_SERVE_CACHE": str(work / "costs" / "w")}
    ran = subprocess.run([sys.executable, "-m", "mm3_codemod", "run", str(written)], capture_output=True, text=True, env=env)
    out: dict = {"run_exit": ran.returncode}
    for key, step, name, folder in COST_STEPS:
        path = written if name == "written" else work / name / "model.py"
        proc = subprocess.run([sys.executable, "-c", COSTS, step, str(path), str(work / "costs" / folder)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            out[key] = {"error": proc.stderr[-1500:]}
            continue
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        out[key + "_s"], out[key] = got["s"], got["answer"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=520)
    a = ap.parse_args()
    t0 = time.time()
    out, work = Path(a.out), Path(tempfile.mkdtemp(prefix="mm3-plugin-"))
    installed = Path(a.site, "vllm", "models", "minimax_m3", "nvidia", "model.py")
    native_text = installed.read_text()
    era_text = fork_era(native_text)
    (work / "native").mkdir()
    (work / "era").mkdir()
    (work / "native" / "model.py").write_text(native_text)
    (work / "era" / "model.py").write_text(era_text)
    report: dict = {"python": sys.version.split()[0], "jobs": {}, "comparisons": []}

    report["costs"] = costs(work)
    print("costs:", report["costs"], flush=True)

    sys.path.insert(0, str(Path(a.site)))
    from rewriter.verify import engine_child as ec
    from rewriter.verify.engine import compare_outputs

    ckpt = work / "tiny-minimax-m3"
    ec.write_checkpoint(str(ckpt), ec.tiny_config({}, ec.DEFAULTS["vocab"]), ec.DEFAULTS["std"], ec.DEFAULTS["seed"])
    served = str(work / "served")
    inproc = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    jobs = [
        ("check fork-era fp8", era_text, FP8, {"MM3_CODEMOD_PLUGIN": "check"}),
        # its own fresh cache: not the verdict the fp8 start before it left (a bf16 start judges nothing)
        ("check fork-era bf16", era_text, "auto",
         {"MM3_CODEMOD_PLUGIN": "check", "MM3_CODEMOD_SERVE_CACHE": str(work / "bf16"), **inproc}),
        ("apply fork-era fp8", era_text, FP8, {"MM3_CODEMOD_PLUGIN": "apply", "MM3_CODEMOD_SERVE_CACHE": served, **inproc}),
        ("check native fp8", native_text, FP8, {"MM3_CODEMOD_PLUGIN": "check", **inproc}),
        ("apply fork-era fp8, engine core process", era_text, FP8,
         {"VLLM_PLUGINS": "mm3_codemod_apply", "MM3_CODEMOD_SERVE_CACHE": served}),
    ]
    jobs.insert(1, ("check fork-era fp8, engine core in-process", era_text, FP8, {"MM3_CODEMOD_PLUGIN": "check", **inproc}))
    # the file `run` wrote (costs()), installed: with the verdict `run` left, and in a fresh cache
    # (patched some other way), where check judges it when its first layer is built for fp8
    written = (work / "written" / "model.py").read_text()
    jobs += [
        ("check run-written fp8", written, FP8,
         {"MM3_CODEMOD_PLUGIN": "check", "MM3_CODEMOD_SERVE_CACHE": str(work / "costs" / "w"), **inproc}),
        ("check run-written fp8, fresh cache", written, FP8,
         {"MM3_CODEMOD_PLUGIN": "check", "MM3_CODEMOD_SERVE_CACHE": str(work / "fresh"), **inproc}),
    ]
    # the same file edited by hand: a comment (right, not run's own: run by the semantic level
    # inside vLLM before the start goes on), and its fp8 write storing with "auto" (stops the start)
    k_slice, write = "        key_cache, value_cache = ", "            main_slot_mapping,\n            self.kv_cache_dtype,\n"
    if k_slice in written and write in written:
        jobs += [
            ("check hand-edited right fp8, fresh cache", written.replace(k_slice, "        # the main cache's halves\n" + k_slice, 1), FP8,
             {"MM3_CODEMOD_PLUGIN": "check", "MM3_CODEMOD_SERVE_CACHE": str(work / "edited"), **inproc}),
            ("check hand-edited broken fp8, fresh cache",
             written.replace(write, write.replace("self.kv_cache_dtype", '"auto"')), FP8,
             {"MM3_CODEMOD_PLUGIN": "check", "MM3_CODEMOD_SERVE_CACHE": str(work / "broken"), **inproc}),
        ]
    # vLLM 0.24 turns on its breakable CUDA graphs by itself, which disables its torch.compile
    # pipeline; these two starts opt out of that, so the served module runs compiled too.
    compiled = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0", **inproc}
    jobs += [
        ("apply fork-era fp8, torch.compile", era_text, FP8,
         {"MM3_CODEMOD_PLUGIN": "apply", "MM3_CODEMOD_SERVE_CACHE": served, **compiled}),
        ("check native fp8, torch.compile", native_text, FP8, {"MM3_CODEMOD_PLUGIN": "check", **compiled}),
    ]
    only = os.environ.get("PLUGIN_ONLY")  # a regex: run only the jobs whose label it finds
    jobs = [j for j in jobs if not only or re.search(only, j[0])]
    logs = []
    for label, text, dtype, extra in jobs:
        left = a.budget - (time.time() - t0)
        if left < 60:
            report["jobs"][label] = {"status": "not-run", "reason": "budget"}
            continue
        installed.write_text(text)
        shutil.rmtree(installed.parent / "__pycache__", ignore_errors=True)
        spec = {
            "job": {"label": label, "file": None, "kv_cache_dtype": dtype, "block_size": 128,
                    "backend": "TRITON_ATTN", "enforce_eager": False},
            "ckpt": str(ckpt), "gpu_memory_utilization": 0.5,
            "env": {"VLLM_DISABLE_COMPILE_CACHE": "1", **extra},
        }
        spec_file = work / f"job{len(logs)}.json"
        spec_file.write_text(json.dumps(spec))
        log = work / f"job{len(logs)}.log"
        t = time.time()
        with open(log, "w") as err:
            p = subprocess.run([sys.executable, str(HERE / "plugin_child.py"), str(spec_file)], stdout=subprocess.PIPE,
                               stderr=err, text=True, timeout=left - 20)
        lines = log.read_text(errors="replace").splitlines()
        try:
            res = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            res = {"status": "no-report", "returncode": p.returncode}
        res["wall_s"] = round(time.time() - t, 1)
        res["mm3_lines"] = [ln[-400:] for ln in lines if "mm3-codemod" in ln][:12]
        res["first_log_line"], res["last_log_line"] = (lines[0][:200], lines[-1][:200]) if lines else ("", "")
        res["compile_lines"] = [ln[-200:] for ln in lines if re.search(r"torch.compile|Dynamo|[Cc]ompil(ed|ing) .*graph|backends.py", ln)][:6]
        res["weight_lines"] = [ln[-200:] for ln in lines if re.search(r"[Ll]oading weights|[Mm]odel loading took|load_weights", ln)][:6]
        res["installed_sha256_after"] = hashlib.sha256(installed.read_bytes()).hexdigest()
        res["installed_unchanged"] = installed.read_text() == text
        report["jobs"][label] = res
        logs.append((label, lines))
        print(f"{label}: {res.get('status')} ({res.get('phase')}) {res.get('seconds')} s in the engine, "
              f"{res.get('since_process_start')} s from process start; {res.get('message', '')[:300]}", flush=True)
        for ln in res["mm3_lines"][:4]:
            print("   ", ln[-300:], flush=True)
    installed.write_text(native_text)

    def outs(label):
        j = report["jobs"].get(label, {})
        return j.get("outputs") if j.get("status") == "ok" else None

    for x, y, what in (
        ("check fork-era bf16", "apply fork-era fp8", "apply fp8 vs bf16"),
        ("check fork-era bf16", "check native fp8", "native fp8 vs bf16 (the noise floor)"),
        ("check native fp8", "apply fork-era fp8", "apply fp8 vs native fp8"),
        ("apply fork-era fp8", "apply fork-era fp8, engine core process", "apply fp8: in-process vs engine-core process"),
        ("check fork-era bf16", "check run-written fp8", "run's file fp8 vs bf16"),
        ("apply fork-era fp8", "check run-written fp8", "apply fp8 vs run's file fp8 (the same bytes)"),
        ("check native fp8, torch.compile", "apply fork-era fp8, torch.compile", "apply fp8 vs native fp8, torch.compile"),
        ("apply fork-era fp8", "apply fork-era fp8, torch.compile", "apply fp8: breakable graphs vs torch.compile"),
    ):
        if outs(x) is not None and outs(y) is not None:
            c = compare_outputs(x, outs(x), y, outs(y))
            report["comparisons"].append({"what": what, **c.to_json()})
            print(what, json.dumps(c.to_json())[:400], flush=True)
        else:
            report["comparisons"].append({"what": what, "missing": True})
    for j in report["jobs"].values():
        j.pop("traceback", None) if j.get("status") == "ok" else None
    (out / "plugin.json").write_text(json.dumps(report, indent=1))
    with open(out / "plugin_logs.txt", "w") as f:
        for label, lines in logs:
            f.write(f"===== {label}\n" + "\n".join(ln for ln in lines if "qutlass" not in ln)[-40000:] + "\n")
    print(f"device script: {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
