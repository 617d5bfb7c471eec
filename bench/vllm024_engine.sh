#!/usr/bin/env bash
# On the GPU machine: the engine level's experiments with vLLM 0.24.0 (issue 23):
# a tiny random-weight MiniMax-M3 served by vllm.LLM from (1) 0.24.0's own
# nvidia/model.py made fork-era (before `mm3-codemod run`: the fp8 run must fail
# with the kernel's bf16-only assert; after: both runs complete), (2) the
# rewritten file's fp8 against 0.24.0's native fp8, each against bf16, (3) the
# same eager and with block sizes 256 and 16, (4) a repeat and known-broken
# variants of the bypass; first, bench/fp8_rounding.py on the kernels. How:
# bench/vllm024_engine.py. The carry is bench/vllm024_pack.sh's (three parts),
# installed by bench/vllm024_carry.sh:
#   bash bench/vllm024_engine.sh store .gpu/v24_1     # carry [".gpu/v24_1"]
#   bash bench/vllm024_engine.sh store .gpu/v24_2     # carry [".gpu/v24_2"]
#   bash bench/vllm024_engine.sh run .gpu/v24_3       # carry [".gpu/v24_3"], timeout_s 600
# `run` exits 3 when an earlier part is missing (a fresh machine): do all again.
# Out: $OUT/transcript.txt, $OUT/engine.json, $OUT/engine_main.log (every run's log tail).
# ENGINE_BUDGET (s, default 500) bounds the experiments; ENGINE_SPEC (JSON) overrides the
# child's spec (e.g. '{"new_tokens": 32}'); ENGINE_ONLY (a regex) picks the runs by label;
# SKIP_ROUNDING=1 leaves out bench/fp8_rounding.py; ENGINE_BACKEND the dense layers' backend;
# MM3_ENGINE_NORM_FALLBACK=1 uses a plain-PyTorch Gemma RMSNorm instead of flashinfer's.
set -uo pipefail
cmd=${1:?usage: vllm024_engine.sh store|run DIR}
dir=${2:?usage: vllm024_engine.sh store|run DIR}
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
[ "$cmd" = run ] || { echo "unknown command $cmd" >&2; exit 2; }

OUT=${OUT:-$H/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/transcript.txt") 2>&1
export PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-160}
v24_install "$dir" || exit $?
export PYTHONPATH="$REPO:$SITE"
cd "$REPO"
step "python, torch, GPU, nvcc"
$PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")'
command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "no nvcc on PATH (flashinfer's JIT norm may fall back)"
step "fp8 rounding: native fused insert vs bypass, same input (bench/fp8_rounding.py)"
[ "${SKIP_ROUNDING:-0}" = 1 ] || $PY bench/fp8_rounding.py --cuda | tee "$OUT/fp8_rounding.json"
step "engine experiments (budget ${ENGINE_BUDGET:-500} s)"
$PY bench/vllm024_engine.py --site "$SITE" --out "$OUT" --budget "$((${ENGINE_BUDGET:-500} - (SECONDS - start)))"
echo "engine script exit $?; device run: $((SECONDS - start)) s"
