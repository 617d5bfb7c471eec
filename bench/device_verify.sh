#!/usr/bin/env bash
# Level 3 of `mm3-codemod verify` on a CUDA machine with a vLLM kernel library
# (see docs/h200.md): rewrite a copy of the bundled before-state example,
# then verify it - padded tokens included, timed at N = 16, 128, 1024, 8192 -
# and the files that must fail: the unpatched original (the real kernel's
# bf16-only assert) and the seed's older bypass (a padded token writes the
# last index slot).
# Usage: bench/device_verify.sh PATH/TO/_C.so [OUTDIR [FORKS_DIR]]
set -uo pipefail
KERNELS=$1
OUT=${2:-$(mktemp -d)}
W=$(mktemp -d)
export COLUMNS=${COLUMNS:-200} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
python_info=$($PY -c 'import torch,sys;print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))')
echo "python/torch/gpu: $python_info"
cp rewriter/data/example_model.py "$W/model.py"
cp rewriter/data/example_model.py "$W/before.py"
$PY -m rewriter run "$W/model.py"; echo "run exit $?"
$PY -m rewriter verify --kernels "$KERNELS" --require-gpu --verbose --json "$W/model.py" >"$OUT/verify.json" 2>"$OUT/verify.txt"
echo "verify (rewritten example) exit $?"; cat "$OUT/verify.txt"
$PY -m rewriter verify --kernels "$KERNELS" --require-gpu --no-timing "$W/before.py" 2>&1 | tail -25
echo "verify (unpatched example) exit ${PIPESTATUS[0]}"
$PY -m rewriter verify --kernels "$KERNELS" --require-gpu --no-timing --verbose fixtures/seed_form/model.py 2>&1 | grep -E "padded|index cache identical|seed_form" | head -8
echo "verify (the seed's form) exit ${PIPESTATUS[0]}"
$PY -m rewriter verify --kernels "$KERNELS" --require-gpu --no-timing fixtures/*/expected.py 2>"$OUT/fixtures.txt"
echo "verify (every fixture's expected.py) exit $?"; tail -3 "$OUT/fixtures.txt"
# The index write `run` generates, on the real reshape_and_cache_flash: bf16 and fp8 e4m3
# index caches, padded tokens skipped (bench/fp8_index_probe.py).
$PY bench/fp8_index_probe.py --kernels "$KERNELS" >"$OUT/fp8_index_probe.json"
echo "fp8 index probe exit $?"; cat "$OUT/fp8_index_probe.json"
# Optional: a folder of files to rewrite and verify (real fork files, generated spelling
# variants; never committed, carried for the run): each is copied and rewritten by `run`,
# then all are verified in one process with the real ops, padded tokens and the compiled
# path included. The reports: $OUT/forks_run.jsonl (the `run --json` reports), $OUT/forks.json.
FORKS=${3:-}
if [ -n "$FORKS" ]; then
  mkdir -p "$W/forks"
  cp "$FORKS"/*.py "$W/forks/"
  for f in "$W"/forks/*.py; do
    $PY -m rewriter run --json "$f" >>"$OUT/forks_run.jsonl" 2>/dev/null
  done
  $PY -m rewriter verify --kernels "$KERNELS" --require-gpu --no-timing --verbose --json "$W"/forks/*.py \
    >"$OUT/forks.json" 2>"$W/verify.txt"
  echo "verify (forks) exit $?"
  $PY - "$OUT/forks_run.jsonl" "$OUT/forks.json" <<'PYEOF'
import json, sys
from pathlib import Path
ran, raw, at = {}, open(sys.argv[1]).read(), 0
decoder = json.JSONDecoder()
while raw[at:].strip():  # one `run --json` report after another
    report, at = decoder.raw_decode(raw, len(raw) - len(raw[at:].lstrip()))
    for f in report["files"]:
        sites = [s for s in f.get("sites", []) if s["state"] != "not-a-site"]
        ran[Path(f["path"]).name] = ", ".join(f"{s['state']} -> {s['action']}" for s in sites) or f["status"]
for f in json.load(open(sys.argv[2]))["files"]:
    name = Path(f["path"]).name
    levels = {lv["level"]: lv for lv in f["levels"]}
    shown = "; ".join(f"{k} {v['status']}" + ("" if v["status"] == "passed" else f" ({v['reason'][:120]})")
                      for k, v in levels.items() if k != "import")
    compiled = any("compiled" in d for lv in f["levels"] for d in lv.get("details", []))
    padded = [d.endswith(": yes") for lv in f["levels"] if lv["level"] == "kernel" for d in lv.get("details", []) if "padded tokens" in d]
    print(f"| {name} | {ran.get(name, '?')} | {shown} | {'both' if compiled else 'eager'} | "
          f"{sum(padded)}/{len(padded)} padded-token checks yes |")
PYEOF
fi
