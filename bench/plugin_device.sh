#!/usr/bin/env bash
# On the GPU machine: the mm3-codemod vLLM plugin with vLLM 0.24.0 (bench/plugin_engine.py).
# The carry is bench/vllm024_pack.sh's (three parts, installed by bench/vllm024_carry.sh), and
# this project built as a wheel into .gpu/mm3 (`pip wheel --no-deps -w .gpu/mm3 .`), installed
# into the same site as a user's `pip install` would: its entry points are what vLLM loads.
#   bash bench/plugin_device.sh store .gpu/v24_1             # carry [".gpu/v24_1"]
#   bash bench/plugin_device.sh store .gpu/v24_2             # carry [".gpu/v24_2"]
#   bash bench/plugin_device.sh run .gpu/v24_3               # carry [".gpu/v24_3", ".gpu/mm3"]
# `run` exits 3 when an earlier part is missing (a fresh machine): do all again.
# Out: $OUT/transcript.txt, $OUT/plugin.json, $OUT/plugin_logs.txt.
set -uo pipefail
cmd=${1:?usage: plugin_device.sh store|run DIR}
dir=${2:?usage: plugin_device.sh store|run DIR}
H=${V24_HOME:-$HOME/v24}
SITE=${V24_SITE:-/tmp/site}
PY=${PY:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
start=$SECONDS
step() { echo; echo "=== [$((SECONDS - start))s] $*"; }
# shellcheck source=bench/vllm024_carry.sh
. "$REPO/bench/vllm024_carry.sh"
if [ "$cmd" = store ]; then
  v24_store "$dir"
  exit $?
fi
OUT=${OUT:-$H/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/transcript.txt") 2>&1
export PYTHONUNBUFFERED=1
v24_install "$dir" || exit $?
step "install mm3-codemod's wheel (its vllm.general_plugins entry points)"
$PY -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --upgrade --target "$SITE" "$REPO"/.gpu/mm3/*.whl || exit 4
export PYTHONPATH="$SITE"
cd /tmp
$PY -c 'from importlib.metadata import entry_points as e; print([x.name for x in e(group="vllm.general_plugins")])'
$PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))'
step "plugin experiments (budget ${PLUGIN_BUDGET:-480} s)"
$PY "$REPO/bench/plugin_engine.py" --site "$SITE" --out "$OUT" --budget "$((${PLUGIN_BUDGET:-480} - (SECONDS - start)))"
echo "exit $?; device run: $((SECONDS - start)) s"
