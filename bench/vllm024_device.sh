#!/usr/bin/env bash
# On the GPU machine: import vLLM 0.24.0's nvidia MiniMax-M3 model module for
# real and run mm3-codemod there with no --kernels (the installed vllm._custom_ops).
# The parts come from bench/vllm024_pack.sh; one device call each, back to back
# (files outside the working tree live only while the machine stays warm), every
# part but the last stored, the last one run (bench/vllm024_carry.sh installs them):
#   bash bench/vllm024_device.sh store .gpu/v24_1     # carry [".gpu/v24_1"]
#   bash bench/vllm024_device.sh store .gpu/v24_2     # carry [".gpu/v24_2"] (a 3-part carry)
#   bash bench/vllm024_device.sh run .gpu/v24_3       # carry [".gpu/v24_3"], the last part
# `run` exits 3 when an earlier part is missing (a fresh machine): do both again.
# What it runs, into $OUT/transcript.txt (and every JSON report into
# $OUT/results.json), then a table:
#   0. the import itself, and every `from vllm… import …` of the fork-era files
#      against this vLLM (MiniMaxM3IndexerMetadata: see the shim below)
#   1. check + verify on 0.24.0's own nvidia/model.py, in place: native
#   2. the bundled example copied over nvidia/model.py: verify, run, verify;
#      then each fixture that ends `patched`, copied beside it as
#      nvidia/v24fx_<name>.py (same package, so the same imports; one verify
#      process for them all): verify, run, verify
#   3. survey --python python3
set -uo pipefail
cmd=${1:?usage: vllm024_device.sh store|run DIR}
dir=${2:?usage: vllm024_device.sh store|run DIR}
H=${V24_HOME:-$HOME/v24}
SITE=${V24_SITE:-/tmp/site}
PY=${PY:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$H"

# shellcheck source=bench/vllm024_carry.sh
. "$REPO/bench/vllm024_carry.sh"
if [ "$cmd" = store ]; then
  v24_store "$dir"
  exit $?
fi
[ "$cmd" = run ] || { echo "unknown command $cmd" >&2; exit 2; }

OUT=${OUT:-$H/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/transcript.txt") 2>&1
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-160}
start=$SECONDS
step() { echo; echo "=== [$((SECONDS - start))s] $*"; }

# --- reassemble, unpack, install (bench/vllm024_carry.sh) ------------------------------
v24_install "$dir" || exit $?
export PYTHONPATH="$REPO:$SITE"
cd "$REPO"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
NV=$SITE/vllm/models/minimax_m3/nvidia
V=$NV/model.py
SA=$SITE/vllm/models/minimax_m3/common/sparse_attention.py
[ -f "$H/model.orig.py" ] || cp "$V" "$H/model.orig.py"
[ -f "$H/sparse_attention.orig.py" ] || cp "$SA" "$H/sparse_attention.orig.py"
cp "$H/model.orig.py" "$V"
cp "$H/sparse_attention.orig.py" "$SA"
rm -f "$NV"/v24fx_*.py
MM=($PY -m mm3_codemod)
T=${STEP_TIMEOUT:-240}

# V24_STEPS picks steps (default all): probe native example fixtures survey kv_forms;
# V24_FIXTURES the fixtures; V24_BEFORE=0 skips their verify before run.
want() { [[ " ${V24_STEPS:-probe native example fixtures survey kv_forms} " == *" $1 "* ]]; }
shim() { printf '\n# mm3-codemod device run: fork-era model files import it from here\nfrom vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerMetadata  # noqa: E402,F401\n' >>"$SA"; }

step "python, torch, GPU"
$PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")'

if want probe; then
step "import vllm.models.minimax_m3.nvidia.model (0.24.0's own)"
timeout "$T" $PY -c '
import time, traceback
t = time.time()
try:
    import vllm, vllm.models.minimax_m3.nvidia.model as m
    print(f"imported {m.__name__} from {m.__file__}, vllm {vllm.__version__}, {time.time() - t:.1f} s")
except BaseException:
    print("\n".join(traceback.format_exc().splitlines()[-12:]))
' 2>&1 | grep -v "^WARNING\|^INFO"

step "the fork-era files' vllm imports against this vLLM"
$PY - rewriter/data/example_model.py fixtures/{fork_era,reformatted,no_insert_kv,half_applied,patch_fuzz,patched}/model.py <<'PYEOF' 2>&1 | grep -v "^WARNING\|^INFO"
import ast, importlib, sys
missing = {}
for f in sys.argv[1:]:
    for n in ast.walk(ast.parse(open(f).read())):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("vllm"):
            try:
                mod = importlib.import_module(n.module)
            except Exception as exc:
                missing.setdefault(f"{n.module} ({type(exc).__name__}: {exc})", set()).add(f)
                continue
            for a in n.names:
                if not hasattr(mod, a.name):
                    try:
                        importlib.import_module(f"{n.module}.{a.name}")
                    except Exception:
                        missing.setdefault(f"{n.module}.{a.name}", set()).add(f)
print(f"{len(sys.argv) - 1} files checked;", "every name resolves" if not missing else "missing:")
for name, files in sorted(missing.items()):
    print(f"  {name}: {len(files)} file(s)")
PYEOF
fi

if want native; then
step "1. check + verify, 0.24.0's own nvidia/model.py in place"
"${MM[@]}" check "$V"; echo "check exit $?"
timeout "$T" "${MM[@]}" verify --no-timing --require-import --require-gpu --json "$V" >"$W/native.json"
echo "verify exit $?"
fi

if want example; then
step "2. the bundled example over nvidia/model.py: verify before run"
cp rewriter/data/example_model.py "$V"
timeout "$T" "${MM[@]}" verify --no-timing --require-gpu --require-import --json "$V" >"$W/example_before.json"
echo "verify exit $?"

step "shim: fork-era files import MiniMaxM3IndexerMetadata from common.sparse_attention; 0.24.0 defines it in common.indexer - re-exported there (the installed copy only)"
shim
timeout "$T" "${MM[@]}" verify --no-timing --require-gpu --require-import --json "$V" >"$W/example_before_shim.json"
echo "verify (with the shim) exit $?"

step "2. run, then verify after (timed)"
"${MM[@]}" run --json "$V" >"$W/example_run.json"; echo "run exit $?"
timeout "$T" "${MM[@]}" verify --require-gpu --require-import --json "$V" >"$W/example_after.json"
echo "verify exit $?"
cp "$H/model.orig.py" "$V"
fi

# fork-era files that end patched; the older bypass forms (outdated -> upgrade); and
# native calls carrying a stale bypass (half-applied -> strip: the native kernel)
FIX=(${V24_FIXTURES:-fork_era reformatted no_insert_kv half_applied patch_fuzz patched
     old_form seed_form seed_split half_native half_native_plain native_stale_bypass wrapper_native})
export V24_FIXTURES="${FIX[*]}"
if want fixtures; then
  grep -q MiniMaxM3IndexerMetadata "$SA" || shim
step "2. fixtures (fork-era, older bypass forms, stale bypasses on native calls), beside it as nvidia/v24fx_<name>.py: ${FIX[*]}"
files=()
for f in "${FIX[@]}"; do cp "fixtures/$f/model.py" "$NV/v24fx_$f.py" && files+=("$NV/v24fx_$f.py"); done
if [ "${V24_BEFORE:-1}" = 1 ]; then
  timeout "$T" "${MM[@]}" verify --no-timing --require-gpu --require-import --json "${files[@]}" >"$W/fixtures_before.json"
  echo "verify before exit $?"
fi
"${MM[@]}" run --json "${files[@]}" >"$W/fixtures_run.json"; echo "run exit $?"
timeout "$T" "${MM[@]}" verify --no-timing --require-gpu --require-import --json "${files[@]}" >"$W/fixtures_after.json"
echo "verify after exit $?"
rm -f "${files[@]}"
fi

if want survey; then
step "3. survey --python $PY"
"${MM[@]}" survey --python "$PY" --json >"$W/survey.json"; echo "survey exit $?"
"${MM[@]}" survey --python "$PY" 2>&1 | tail -8
fi

cp "$H/sparse_attention.orig.py" "$SA"
step "summary"
$PY - "$W" "$OUT/results.json" <<'PYEOF'
import json, os, sys
w, out = sys.argv[1:]
reports = {}
for name in sorted(os.listdir(w)):
    try:
        reports[name[:-5]] = json.load(open(os.path.join(w, name)))
    except (OSError, ValueError) as exc:
        reports[name[:-5]] = {"unreadable": str(exc)}
json.dump(reports, open(out, "w"), indent=1)

def levels(report, path_end):
    for f in report.get("files", []):
        if f["path"].endswith(path_end):
            return {lv["level"]: lv for lv in f["levels"]}, f
    return {}, None

def short(lv):
    return lv["status"] if lv else "-"

def first_failure(lvs):
    """import/semantic/kernel statuses, then the kernel's (else the first) failure."""
    marks = "/".join(short(lvs.get(n))[:4] for n in ("import", "semantic", "kernel"))
    for name in ("kernel", "semantic", "import"):
        lv = lvs.get(name)
        if lv and lv["status"] == "failed":
            return f"{marks}; {name}: {lv['reason'][:90]}".replace("|", "/")
    return marks

def run_state(report, path_end):
    for f in report.get("files", []):
        if f["path"].endswith(path_end):
            return f["status"]
    return "-"

rows = []
nat, _ = levels(reports.get("native", {}), "nvidia/model.py")
rows.append(("0.24.0 nvidia/model.py (native)", "-", "-", nat))
b, _ = levels(reports.get("example_before", {}), "nvidia/model.py")
bs, _ = levels(reports.get("example_before_shim", {}), "nvidia/model.py")
a, _ = levels(reports.get("example_after", {}), "nvidia/model.py")
rows.append(("bundled example", first_failure(bs), run_state(reports.get("example_run", {}), "model.py"), a))
for fx in os.environ["V24_FIXTURES"].split():
    end = f"v24fx_{fx}.py"
    b, _ = levels(reports.get("fixtures_before", {}), end)
    a, _ = levels(reports.get("fixtures_after", {}), end)
    rows.append((f"fixtures/{fx}", first_failure(b), run_state(reports.get("fixtures_run", {}), end), a))
print("| file | verify before run (import/semantic/kernel; a failure) | run | after: import | semantic | kernel |")
print("|---|---|---|---|---|---|")
for name, before, run, after in rows:
    print(f"| {name} | {before} | {run} | {short(after.get('import'))} | {short(after.get('semantic'))} | {short(after.get('kernel'))} |")
if b.get("import"):
    print(f"\nbundled example before run, before the shim, import: {b['import']['status']}: {b['import']['reason'][:300]}")
imp = nat.get("import")
if imp:
    print(f"\nnative import: {imp['status']}: {imp['reason']}")
ea, _ = levels(reports.get("example_after", {}), "nvidia/model.py")
for name in ("import", "kernel"):
    if ea.get(name):
        print(f"example after run, {name}: {ea[name]['status']}: {ea[name]['reason'][:300]}")
k = reports.get("example_after", {}).get("kernel") or {}
print(f"kernels: {k.get('source')}; layout {k.get('cache_layout')}; schema extras {k.get('schema_extra')}; skipped: {k.get('skipped')}")
for c in k.get("checks", []):
    print(f"  {'ok' if c['passed'] else 'FAILED'} {c['name']}: {c['detail']}")
ex = next((f for f in reports.get("example_after", {}).get("files", [])), None)
if ex and ex.get("timings"):
    for r in ex["timings"]["rows"]:
        if r["tokens"] == 8192:
            print(f"  N=8192 {r['name']}: {r['us']} us")
for f in reports.get("survey", {}).get("files", []):
    if f["path"].endswith("nvidia/model.py"):
        states = ", ".join(f"{s['class']}.{s['method']}: {s['state']}" for s in f["sites"] if s["state"] != "not-a-site")
        print(f"survey: {f['path']}: vllm {f.get('vllm_version')}, {f['status']}, {states} ({f.get('origin')})")
PYEOF

if want kv_forms; then
step "4. bench/kv_forms.py with this vLLM's kernel library (the fork-era ops' floor)"
timeout "${KV_FORMS_TIMEOUT:-150}" $PY bench/kv_forms.py "$SITE/vllm/_C_stable_libtorch.abi3.so" --json "$OUT/kv_forms.json" 2>&1 |
  grep -v "^WARNING\|^INFO"
echo "kv_forms exit ${PIPESTATUS[0]}"
fi
echo "device run: $((SECONDS - start)) s"
