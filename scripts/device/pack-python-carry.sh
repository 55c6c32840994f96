#!/usr/bin/env bash
# Prepares, here, the Python part of what scripts/device/gpu-python.sh needs on the
# GPU machine (which has PyTorch, transformers, numpy, ml_dtypes and grpcio
# 1.84, no network, and a protobuf too old or unknown for our stubs):
#  - .device-carry/wheels: the attnserve package as a wheel (stubs generated
#    here from proto/), protobuf 7.36.2 (the generated code needs >= 7.35.1, < 8)
#    and grpcio-health-checking 1.84.0, for Python 3.12 on manylinux x86-64;
#    the commit they were built from in .device-carry/wheels/COMMIT. The
#    attnserve wheel is built by DEVICE_PYTHON (default python3.12, the GPU
#    machine's; .venv/bin/python for a `gpu-python.sh --cpu` trial here) with
#    attnserve._native (gRPC C++), which finds the carried gRPC libraries
#    (.device-carry/lib) from where gpu-python.sh installs it
#    (.device-carry/pylib/attnserve): an RPATH of $ORIGIN/../../lib, DT_RPATH so
#    that it also serves libgrpc++'s own dependencies. pip fetches the build
#    requirements (setuptools, grpcio-tools) for that Python.
#  - with --bundle: .device-carry/server.tgz, the server binaries and libraries
#    (.device-carry/bin and lib, from scripts/device/pack-device-deps.sh --server)
#    compressed into one file, for when bin + lib + wheels + the tree exceed
#    the device tool's 64 MiB carry; gpu-python.sh unpacks it when there is no
#    .device-carry/bin.
# Prints what the carry weighs and the carry list for `run`.
# Usage: scripts/device/pack-python-carry.sh [--bundle]
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=0
case ${1:-} in
  --bundle) bundle=1 ;;
  "") ;;
  *) echo "usage: scripts/device/pack-python-carry.sh [--bundle]" >&2; exit 2 ;;
esac
py=$(scripts/python-env.sh)   # .venv: downloads the runtime wheels
wheels=.device-carry/wheels
rm -rf "$wheels"
mkdir -p "$wheels"
device_py=${DEVICE_PYTHON:-}
if [ -z "$device_py" ]; then  # python3.12 on PATH, else pyenv's
  for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python; do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      device_py=$candidate
      break
    fi
  done
  [ -n "$device_py" ] || { echo "no Python 3.12 here: set DEVICE_PYTHON" >&2; exit 1; }
fi
# shellcheck disable=SC2016  # $ORIGIN is the dynamic loader's, not the shell's
env -u PYTHONPATH LDFLAGS='-Wl,--disable-new-dtags,-rpath,$ORIGIN/../../lib' \
  "$device_py" -m pip wheel -q --no-deps -w "$wheels" ./python
compgen -G "$wheels/attnserve-*-linux_x86_64.whl" >/dev/null ||
  { echo "the attnserve wheel has no attnserve._native (no gRPC C++ here?)" >&2; exit 1; }
# pip matches manylinux tags exactly: name the ones protobuf's wheels use.
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$wheels" \
  "$(grep -E '^protobuf==' requirements/python-client.txt)" \
  "$(grep -E '^grpcio-health-checking==' requirements/python-client.txt)"
git rev-parse HEAD >"$wheels/COMMIT" 2>/dev/null || echo unknown >"$wheels/COMMIT"
ls -l "$wheels"

carry=(.device-carry/wheels)
if [ "$bundle" = 1 ]; then
  [ -x .device-carry/bin/attnserve ] ||
    { echo "no .device-carry/bin/attnserve: run scripts/device/pack-device-deps.sh --server BUILD first" >&2; exit 1; }
  tar -C .device-carry -czf .device-carry/server.tgz bin lib
  carry+=(.device-carry/server.tgz)
else
  carry+=(.device-carry/bin .device-carry/lib)
fi
# The device tool sends the tracked tree and the carried paths: 64 MiB in all.
tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
carried=$(du -cb "${carry[@]}" 2>/dev/null | tail -1 | cut -f1)
total=$((tree + carried))
limit=$((64 << 20))
awk -v t="$tree" -v c="$carried" 'BEGIN {
  printf "carry: tree %d + carried %d = %d bytes (%.1f MiB of 64)\n", t, c, t + c, (t + c) / 1048576 }'
if [ "$total" -gt "$limit" ]; then
  echo "over the 64 MiB limit: run with --bundle (or slim .device-carry/lib)" >&2
  exit 1
fi
printf 'run carry: ['
printf '"%s", ' "${carry[@]}" | sed 's/, $//'
printf ']\n'
