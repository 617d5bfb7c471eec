# Sourced by bench/vllm024_device.sh and bench/vllm024_engine.sh (not run by itself):
# the carry of bench/vllm024_pack.sh on the GPU machine. Needs H (where the parts
# are kept between the calls of one lease), SITE (where it is installed), PY and
# a `step` function. Both scripts take the parts the same way, one device call
# each, back to back (files outside the working tree live only while the
# machine stays warm):
#   bash bench/<script> store .gpu/v24_1          # carry [".gpu/v24_1"]
#   bash bench/<script> store .gpu/v24_2          # carry [".gpu/v24_2"] (three parts)
#   bash bench/<script> run .gpu/v24_N            # carry [".gpu/v24_N"], the last part
# `run` exits 3 when an earlier part is missing (a fresh machine: do all again),
# 4 when the parts do not make the packed tar or it does not install.

# v24_store DIR: keep this call's part for the run call.
v24_store() {
  mkdir -p "$H" && cp "$1"/v24.tar.xz.* "$H"/ && ls -l "$H"
}

# v24_install DIR: DIR holds the last part, its v24.parts and v24.sha256; reassemble,
# check, unpack, pip-install the wheels and copy the vllm package into $SITE, unless
# this very carry (same sha256) is installed there already. Returns 0, 3 or 4.
v24_install() {
  local dir=$1 n i parts got want
  n=$(cat "$dir/v24.parts")
  want=$(cat "$dir/v24.sha256")
  mkdir -p "$H"
  cp "$dir/v24.tar.xz.$n" "$H/"
  for i in $(seq 1 "$n"); do
    [ -f "$H/v24.tar.xz.$i" ] || { echo "part $i of $n is not in $H: a fresh machine; run the store call(s) again"; return 3; }
  done
  if [ -f "$SITE/.v24.sha256" ] && [ "$(cat "$SITE/.v24.sha256")" = "$want" ]; then
    return 0
  fi
  step "unpack $n parts"
  parts=$(for i in $(seq 1 "$n"); do echo "$H/v24.tar.xz.$i"; done)
  got=$(cat $parts | sha256sum | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "sha256 mismatch: $got"; return 4; }
  rm -rf "$H/x" && mkdir -p "$H/x"
  if command -v xz >/dev/null; then
    cat $parts | xz -dc -T0 | tar -x -C "$H/x"
  else
    cat $parts | $PY -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 24)" | tar -x -C "$H/x"
  fi || { echo "unpack failed"; return 4; }
  $PY -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$H"/x/whl/*.whl ||
    { echo "pip install of the carried wheels failed"; return 4; }
  cp -a "$H/x/site/." "$SITE/"
  echo "$want" >"$SITE/.v24.sha256"
}
