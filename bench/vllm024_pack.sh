#!/usr/bin/env bash
# Pack what importing vllm.models.minimax_m3.nvidia.model from the vllm==0.24.0
# wheel needs on the GPU machine (python3 3.12, torch 2.11.0+cu130, no vLLM, no
# network, <= 64 MiB a call) into .gpu/v24_N (git-ignored), for
# bench/vllm024_device.sh. Runs here, in the repository root; nothing is committed.
# Parts .gpu/v24_1, .gpu/v24_2, ..., 58 MiB at most each: one device call each
# (two for the model import alone, V24_ENGINE=0; three with the offline engine's
# carry, the default: see bench/vllm024_engine.sh).
#
#   bash bench/vllm024_pack.sh          # then the two device calls: see docs/h200.md,
#                                       # "Verified against vLLM 0.24.0"
#
# One tar, xz-compressed (XZ_LEVEL, default -9e; -2 packs in minutes on a busy 2-core machine) and split, holding:
#   site/vllm/…                the wheel's Python package (.py, .json, .jinja) and the
#                              kernel libraries the import reaches on a CUDA machine:
#                              _C_stable_libtorch.abi3.so (ops, read at import time)
#                              and vllm_flash_attn/_vllm_fa3_C.abi3.so (fa_utils imports
#                              vllm.vllm_flash_attn on CUDA, which raises without FA2
#                              or FA3; FA3 is the smaller and the H200's), and
#                              _moe_C_stable_libtorch.abi3.so (the MoE layers' ops,
#                              loaded by the CUDA platform; the engine's carry only).
#                              FlashMLA, qutlass are optional
#   site/vllm-0.24.0.dist-info importlib.metadata's version of vllm (survey, verify)
#   whl/*.whl                  third-party wheels the device image lacks, cp312
#                              manylinux x86_64 (found by importing the module here
#                              with vLLM's ops stubbed: each ModuleNotFoundError
#                              named one), and this project's own dependencies
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PY:-python3}
CACHE=${MM3_CODEMOD_WHEEL_CACHE:-$HOME/.cache/mm3-codemod/wheels}
PART_MB=${PART_MB:-58}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

# What the import of the nvidia model module reaches that the device image lacks
# (its pip list: /work/.library/device/KINDS.md), pinned to the versions that
# imported together here, and the project's own (libcst; typer, rich and theirs,
# carried whatever the device has: typer 0.29 needs pydantic and annotated-doc).
WHEELS=(
  annotated-types==0.8.0 anyio==4.16.0 cachetools==8.0.2 cbor2==6.3.0
  httpcore2==2.16.2 httpx2==2.16.2 idna==3.20 openai==3.60.0 openai-harmony==0.0.8
  pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1
  truststore==0.10.5 typing-extensions==4.16.0 typing-inspection==0.4.5
  libcst==1.9.0 typer==0.29.2 rich==15.0.0 click==8.5.1 shellingham==1.5.4
  markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 annotated-doc==0.0.7
)
# What `from vllm import LLM` and building and running the offline engine reach
# besides (bench/vllm024_engine.sh; found the same way, with vLLM's ops and CUDA
# stubbed and a CUDA platform forced): msgspec (sampling params); llguidance and
# xgrammar (structured-output classes annotated with their types, evaluated at
# import); apache-tvm-ffi (xgrammar 0.2.9 needs >= 0.1.11: vLLM's own pin, 0.1.9,
# is for its optional cute kernels); fastapi, starlette (pooling entrypoints);
# partial-json-parser (tool parsers); flashinfer-python (MiniMax-M3's Gemma
# RMSNorm is flashinfer.norm, JIT-built with the device's nvcc); depyf, astor,
# dill (vLLM's compile-time checks under CUDA graphs).
ENGINE_WHEELS=(
  msgspec==0.23.0 llguidance==1.7.6 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
  fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7
  flashinfer-python==0.6.12 depyf==0.20.0 astor==0.8.1 dill==0.4.1
)
# V24_ENGINE=0 packs the model-import carry alone (two parts), as before.
if [ "${V24_ENGINE:-1}" = 1 ]; then
  WHEELS+=("${ENGINE_WHEELS[@]}")
  SO_EXTRA="vllm/_moe_C_stable_libtorch.abi3.so"
else
  SO_EXTRA=""
fi

exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"

whl=$(ls "$CACHE"/vllm-0.24.0-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  mkdir -p "$CACHE"
  $PY -m pip download -q --no-deps vllm==0.24.0 -d "$CACHE"
  whl=$(ls "$CACHE"/vllm-0.24.0-*.whl | head -1)
fi
echo "vllm wheel: $whl"

mkdir -p "$W/pack/site" "$W/pack/whl"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  -d "$W/pack/whl" "${WHEELS[@]}"
echo "wheels: $(ls "$W/pack/whl" | wc -l) ($(du -sh "$W/pack/whl" | cut -f1))"

$PY - "$whl" "$W/pack/site" $SO_EXTRA <<'PYEOF'
import sys, zipfile
whl, dest, *extra = sys.argv[1:]
keep_ext = (".py", ".json", ".jinja", ".typed")
with zipfile.ZipFile(whl) as z:
    names = [
        n for n in z.namelist()
        if (n.startswith("vllm/") and n.endswith(keep_ext) and not n.startswith("vllm/third_party/"))
        or n in ("vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", *extra)
        or (n.startswith("vllm-0.24.0.dist-info/") and not n.endswith("RECORD"))
    ]
    z.extractall(dest, names)
print(f"vllm files: {len(names)}")
PYEOF
# vllm/third_party holds headers and deep_gemm/fmha builds the import does not reach;
# keep its Python files (some are imported behind try) but none of the rest.
$PY - "$whl" "$W/pack/site" <<'PYEOF'
import sys, zipfile
whl, dest = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("vllm/third_party/") and n.endswith(".py")])
PYEOF
du -sh "$W/pack/site/vllm"

tar -C "$W/pack" -cf - site whl | xz "${XZ_LEVEL:--9e}" -T2 -c >"$W/v24.tar.xz"
echo "v24.tar.xz: $(du -m "$W/v24.tar.xz" | cut -f1) MiB"
rm -rf .gpu/v24_*
split -b "${PART_MB}M" -d -a 1 "$W/v24.tar.xz" "$W/v24.tar.xz.part"
n=0
for p in "$W"/v24.tar.xz.part*; do
  n=$((n + 1))
  mkdir -p ".gpu/v24_$n"
  mv "$p" ".gpu/v24_$n/v24.tar.xz.$n"
done
sha256sum "$W/v24.tar.xz" | cut -d' ' -f1 >".gpu/v24_$n/v24.sha256"
echo "$n" >".gpu/v24_$n/v24.parts"
du -sh .gpu/v24_*
[ "$n" -le "${MAX_PARTS:-4}" ] || { echo "more than ${MAX_PARTS:-4} parts: $n" >&2; exit 1; }
