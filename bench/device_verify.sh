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
# Optional: a folder of real fork files (never committed; carried for the run): each
# is copied, rewritten by `run`, then verified with the real ops, padded tokens and
# the compiled path included. One JSON report per line in $OUT/forks.jsonl.
FORKS=${3:-}
if [ -n "$FORKS" ]; then
  for f in "$FORKS"/*.py; do
    n=$(basename "$f" .py)
    cp "$f" "$W/$n.py"
    $PY -m rewriter run "$W/$n.py" >/dev/null 2>"$W/run.txt"; rc=$?
    $PY -m rewriter verify --kernels "$KERNELS" --require-gpu --no-timing --verbose --json "$W/$n.py" >"$W/v.json" 2>/dev/null
    vrc=$?
    cat "$W/v.json" >>"$OUT/forks.jsonl"
    $PY - "$W/v.json" "$n" "$rc" "$vrc" <<'PYEOF'
import json, sys
report, name, run_rc, verify_rc = json.load(open(sys.argv[1])), *sys.argv[2:]
levels = {lv["level"]: lv for lv in report["files"][0]["levels"]}
print(f"{name}: run exit {run_rc}, verify exit {verify_rc}: " + "; ".join(
    f"{k} {v['status']} ({v['reason'][:150]})" for k, v in levels.items() if k != "import"))
PYEOF
  done
fi
